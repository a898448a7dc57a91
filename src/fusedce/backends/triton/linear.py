"""The Triton backend's per-chunk cross-entropy, plugged into the shared linear chunk loop.

Per chunk the forward kernel writes loss/lse (reading the chunk's logits once) and the backward kernel
overwrites the chunk's logits with their gradient (one more read, one write): the logits buffer of a
chunk is the only n_c x V memory the loss ever holds.
"""
from __future__ import annotations

import functools

import torch

from ..linear import linear_cross_entropy as _linear_cross_entropy
from .launch import ce_backward, ce_forward


def _w(w, w_sum):
    return (None, None) if w is None else (w.contiguous(), w_sum.reshape(1))


class TritonChunkCE:
    """``ChunkCE`` with the Triton kernels (CUDA, or the interpreter in tests)."""

    @staticmethod
    def loss(logits, target, w, w_sum, opts, stats):
        n = logits.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(loss)
        predicted = torch.empty(n, dtype=torch.int64, device=logits.device) if stats else None
        ce_forward(logits, target, *_w(w, w_sum), opts, loss, lse, predicted)
        return loss, lse, predicted

    @staticmethod
    def grad_(logits, target, w, w_sum, lse, grad_row, opts):
        ce_backward(logits, target, *_w(w, w_sum), lse, grad_row, opts, logits)


linear_cross_entropy = functools.partial(_linear_cross_entropy, TritonChunkCE)
