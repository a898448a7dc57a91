"""Megatron-core: ``patch_megatron`` / ``unpatch_megatron`` (``patch.py``: a ``GPTModel``'s loss through the
vocabulary-parallel fused linear cross-entropy; ``head.py``: what replaces the logits; ``options.py``: the
loss options, ``LOSS_OPTIONS``; ``version.py``: the installed megatron-core checked) and
``megatron_token_log_probs`` (``log_probs.py``: per-token log-probs / entropy for RL). megatron-core is
imported only when a function here is called."""
from fusedce.integrations.megatron.log_probs import megatron_token_log_probs
from fusedce.integrations.megatron.options import LOSS_OPTIONS
from fusedce.integrations.megatron.patch import patch_megatron, unpatch_megatron

__all__ = ["LOSS_OPTIONS", "megatron_token_log_probs", "patch_megatron", "unpatch_megatron"]
