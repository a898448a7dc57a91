"""The Triton backend's per-chunk cross-entropy, plugged into the shared linear chunk loop.

Per chunk the forward kernel writes loss/lse/lse_lo (reading the chunk's logits once) and the backward
kernel overwrites the chunk's logits with their gradient (one more read, one write): the logits buffer
of a chunk is the only n_c x V memory the loss ever holds.
"""
from __future__ import annotations

import functools

from ..linear import linear_cross_entropy as _linear_cross_entropy
from . import custom_ops


def _w(w, w_sum):
    return (None, None) if w is None else (w.contiguous(), w_sum.reshape(1))


class TritonChunkCE:
    """``ChunkCE`` with the Triton kernels (CUDA, or the interpreter in tests)."""

    @staticmethod
    def loss(logits, target, w, w_sum, opts, stats):
        return custom_ops.forward(logits, target, *_w(w, w_sum), opts, stats)

    @staticmethod
    def grad_(logits, target, w, w_sum, lse, lse_lo, grad_row, grad_lse, opts):
        custom_ops.backward_(logits, target, *_w(w, w_sum), lse, lse_lo, grad_row, grad_lse, opts)


linear_cross_entropy = functools.partial(_linear_cross_entropy, TritonChunkCE)
