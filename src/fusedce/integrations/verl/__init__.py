"""fusedce as verl's fused log-prob + entropy kernels (verl 0.9.1; docs/verl.md).

Opt-in: importing this module activates the plugin (verl imports it with
``actor_rollout_ref.model.external_lib=fusedce.integrations.verl``); ``patch_verl()`` does the same
explicitly, ``unpatch_verl()`` undoes it, :func:`configure` sets its options.
"""
from fusedce.integrations.verl.options import configure
from fusedce.integrations.verl.patch import is_patched, patch_verl, unpatch_verl
from fusedce.integrations.verl.version import SUPPORTED_VERL

patch_verl()

__all__ = ["configure", "is_patched", "patch_verl", "unpatch_verl", "SUPPORTED_VERL"]
