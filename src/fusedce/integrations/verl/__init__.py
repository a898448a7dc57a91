"""fusedce as verl's fused log-prob + entropy kernels (verl 0.9.1; docs/verl.md).

Opt-in: importing this module activates the plugin; nothing happens when fusedce is merely installed. verl
imports it for you with ``actor_rollout_ref.model.external_lib=fusedce.integrations.verl`` (in every
worker that builds the model); ``patch_verl()`` does the same explicitly, ``unpatch_verl()`` undoes it.

With verl's ``actor_rollout_ref.model.use_fused_kernels=True`` (any ``impl_backend``), the FSDP/HF engine's
and the Megatron engine's fused log-probs and entropy are fusedce's (``patch.py``): fp32 logits from a bf16
head, the model's softcap and logit scale, Σπ² (``calculate_sum_pi_squared``), optional batch invariance
and the rollout's top-k / top-p, set with ``$FUSEDCE_VERL`` or :func:`configure` (``options.py``). A verl
other than 0.9.1, or one whose functions differ from what the plugin was written against, is refused with
``RuntimeError`` at import; without verl the import raises ``ImportError``.
"""
from fusedce.integrations.verl.options import configure
from fusedce.integrations.verl.patch import is_patched, patch_verl, unpatch_verl
from fusedce.integrations.verl.version import SUPPORTED_VERL

patch_verl()

__all__ = ["configure", "is_patched", "patch_verl", "unpatch_verl", "SUPPORTED_VERL"]
