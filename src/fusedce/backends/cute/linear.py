"""The CuTe backend's per-chunk cross-entropy, plugged into the shared linear chunk loop.

Per chunk one fused kernel (``kernels/ce_chunk.py``) writes loss / lse / lse_lo and overwrites the
chunk's logits with their gradient (read once, written once from HBM); a backward that recomputes
(reduction "none", a second backward) runs the backward kernel alone on logits whose lse is known.
"""
from __future__ import annotations

import functools

import torch

from ..chunk_loop import linear_cross_entropy as _linear_cross_entropy
from . import launch


def _w(w, weight_sum):
    return (None, None) if w is None else (w.contiguous(), weight_sum.reshape(1))


def _buffers(logits, stats):
    n = logits.shape[0]
    new = lambda dtype=torch.float32: logits.new_empty(n, dtype=dtype)   # noqa: E731
    return new(), new(), new(), (new(torch.int64) if stats else logits.new_empty(0, dtype=torch.int64))


class CuteChunkCE:
    """``ChunkCE`` (``backends/chunk_loop/api.py``) with the CuTe kernels (CUDA)."""

    @staticmethod
    def loss(logits, target, w, weight_sum, opts, stats):
        loss, lse, lse_lo, predicted = _buffers(logits, stats)
        launch.ce_forward(logits, target, *_w(w, weight_sum), opts, loss, lse, lse_lo, predicted if stats else None)
        return loss, lse, lse_lo, predicted

    @staticmethod
    def loss_and_grad_(logits, target, w, weight_sum, grad_row, z_grad_row, opts, stats):
        loss, lse, lse_lo, predicted = _buffers(logits, stats)
        token_weight = logits.new_empty(logits.shape[0], dtype=torch.float32) if opts.use_token_scaling else None
        launch.ce_chunk_(logits, target, *_w(w, weight_sum), grad_row, z_grad_row, opts, loss, lse, lse_lo,
                         predicted if stats else None, token_weight)
        return loss, lse, lse_lo, predicted, token_weight

    @staticmethod
    def grad_(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, opts):
        launch.ce_backward(logits, target, *_w(w, weight_sum), lse, lse_lo, grad_row, grad_lse, opts, logits)


linear_cross_entropy = functools.partial(_linear_cross_entropy, CuteChunkCE)
