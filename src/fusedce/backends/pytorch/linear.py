"""The PyTorch backend's per-chunk cross-entropy, plugged into the chunked LM head (``fusedce.lm_head``)."""
from __future__ import annotations

from .custom_ops import rows_grad_, rows_loss, rows_loss_grad_, rows_token_stats


class TorchChunkCE:
    """``ChunkCE`` in plain PyTorch (row sub-chunks keep the fp32 temporaries small; each loop one custom op)."""
    NAME = "torch"   # the backend's name (lm_head/loop.py finds this class by it)


    @staticmethod
    def loss(logits, target, w, weight_sum, opts, stats, entropy=False):
        return rows_loss(logits, target, w, weight_sum, opts, stats, entropy)

    @staticmethod
    def grad_(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, opts, grad_entropy=None,
              entropy=None, out=None):
        rows_grad_(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, opts, out=out,
                   grad_entropy=grad_entropy, entropy=entropy)

    @staticmethod
    def token_stats(logits, target, lse, lse_lo, opts):
        return rows_token_stats(logits, target, lse, lse_lo, opts)

    @staticmethod
    def loss_and_grad_(logits, target, w, weight_sum, grad_row, z_grad_row, opts, stats):
        return rows_loss_grad_(logits, target, w, weight_sum, grad_row, z_grad_row, opts, stats)

