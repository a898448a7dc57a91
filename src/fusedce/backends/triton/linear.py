"""The Triton backend's per-chunk cross-entropy, plugged into the shared linear chunk loop.

Per chunk, one fused kernel (``kernels/ce_chunk.py``) writes loss/lse/lse_lo and overwrites the chunk's
logits with their gradient: one launch, the chunk read once from HBM (the second read of each row hits
L2) and written once. A backward that recomputes (reduction "none", or a second backward) runs the
backward kernel alone on logits whose lse is known. The logits buffer of a chunk is the only n_c x V
memory the loss ever holds. The RL ops (``token_log_probs``) ask ``loss(..., entropy=True)`` (the
forward kernel with COMPUTE_ENTROPY) and ``grad_(..., grad_entropy=, entropy=, out=)`` (the backward
kernel with HAS_GRAD_ENTROPY, into ``out`` when given).
"""
from __future__ import annotations

import functools

from ..chunk_loop import linear_cross_entropy as _linear_cross_entropy
from ..chunk_loop import log_probs as _log_probs
from ..chunk_loop import log_probs_multi as _log_probs_multi
from . import custom_ops
from .tiled import TRITON_TILED


def _w(w, weight_sum):
    return (None, None) if w is None else (w.contiguous(), weight_sum.reshape(1))


class TritonChunkCE:
    """``ChunkCE`` with the Triton kernels (CUDA, or the interpreter in tests)."""

    @staticmethod
    def loss(logits, target, w, weight_sum, opts, stats, entropy=False):
        if entropy:
            return custom_ops.forward_entropy(logits, target, *_w(w, weight_sum), opts, stats)
        return custom_ops.forward(logits, target, *_w(w, weight_sum), opts, stats)

    @staticmethod
    def token_stats(logits, target, lse, lse_lo, opts):
        from .token_stats import chunk_token_stats
        return chunk_token_stats(logits, target, lse, lse_lo, opts)

    @staticmethod
    def loss_and_grad_(logits, target, w, weight_sum, grad_row, z_grad_row, opts, stats):
        return custom_ops.loss_and_grad_(logits, target, *_w(w, weight_sum), grad_row, z_grad_row, opts, stats)

    @staticmethod
    def grad_(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, opts, grad_entropy=None,
              entropy=None, out=None):
        custom_ops.backward_(logits, target, *_w(w, weight_sum), lse, lse_lo, grad_row, grad_lse, opts,
                             grad_entropy, entropy, out)


linear_cross_entropy = functools.partial(_linear_cross_entropy, TritonChunkCE, tiled=TRITON_TILED)
token_log_probs = functools.partial(_log_probs.token_log_probs, TritonChunkCE)
linear_token_log_probs = functools.partial(_log_probs.linear_token_log_probs, TritonChunkCE, tiled=TRITON_TILED)
token_log_probs_multi = functools.partial(_log_probs_multi.token_log_probs_multi, TritonChunkCE)
linear_token_log_probs_multi = functools.partial(_log_probs_multi.linear_token_log_probs_multi, TritonChunkCE,
                                               tiled=TRITON_TILED)
