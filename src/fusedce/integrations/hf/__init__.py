"""Hugging Face: ``patch_causal_lm`` / ``unpatch_causal_lm`` (``patch.py``), the head's call under hooks and
adapters (``call.py``, ``adapters.py``), the family's logit transform (``head.py``), the loss options
(``options.py``: ``LOSS_OPTIONS``), outputs and token weights (``output.py``, ``token_weights.py``)."""
from fusedce.integrations.hf.options import LOSS_OPTIONS
from fusedce.integrations.hf.patch import patch_causal_lm, unpatch_causal_lm

__all__ = ["LOSS_OPTIONS", "patch_causal_lm", "unpatch_causal_lm"]
