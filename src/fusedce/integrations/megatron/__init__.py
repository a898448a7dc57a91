"""Megatron-core: ``patch_megatron`` / ``unpatch_megatron`` and ``megatron_token_log_probs``; megatron-core is
imported only when a function here is called."""
from fusedce.integrations.megatron.log_probs import megatron_token_log_probs
from fusedce.integrations.megatron.options import LOSS_OPTIONS
from fusedce.integrations.megatron.patch import patch_megatron, unpatch_megatron

__all__ = ["LOSS_OPTIONS", "megatron_token_log_probs", "patch_megatron", "unpatch_megatron"]
