"""The PyTorch backend's per-chunk cross-entropy, plugged into the shared linear chunk loop."""
from __future__ import annotations

import functools

from ..chunk_loop import linear_cross_entropy as _linear_cross_entropy
from ..chunk_loop import log_probs as _log_probs
from ..chunk_loop import log_probs_multi as _log_probs_multi
from ..chunk_loop.loop import loss_then_grad_
from .custom_ops import TORCH_TILED, rows_grad_, rows_loss, rows_token_stats


class TorchChunkCE:
    """``ChunkCE`` in plain PyTorch (row sub-chunks keep the fp32 temporaries small; each loop one custom op)."""

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

    @classmethod
    def loss_and_grad_(cls, logits, target, w, weight_sum, grad_row, z_grad_row, opts, stats):
        return loss_then_grad_(cls, logits, target, w, weight_sum, grad_row, z_grad_row, opts, stats)


linear_cross_entropy = functools.partial(_linear_cross_entropy, TorchChunkCE, tiled=TORCH_TILED)
token_log_probs = functools.partial(_log_probs.token_log_probs, TorchChunkCE)
linear_token_log_probs = functools.partial(_log_probs.linear_token_log_probs, TorchChunkCE, tiled=TORCH_TILED)
token_log_probs_multi = functools.partial(_log_probs_multi.token_log_probs_multi, TorchChunkCE)
linear_token_log_probs_multi = functools.partial(_log_probs_multi.linear_token_log_probs_multi, TorchChunkCE,
                                               tiled=TORCH_TILED)
