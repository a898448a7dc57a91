"""The PyTorch backend's per-chunk cross-entropy, plugged into the chunked LM head (``fusedce.lm_head``)."""
from __future__ import annotations

from .custom_ops import rows_grad_, rows_loss, rows_loss_grad_, rows_token_stats


class TorchChunkCE:
    """``ChunkCE`` in plain PyTorch: the row ops of ``custom_ops.py``, called directly (each loop one custom op)."""
    NAME = "torch"   # the backend's name (lm_head/loop.py finds this class by it)
    loss = staticmethod(rows_loss)
    grad_ = staticmethod(rows_grad_)
    token_stats = staticmethod(rows_token_stats)
    loss_and_grad_ = staticmethod(rows_loss_grad_)
