"""Float64 references for the bench, compared chunk by chunk.

A BT x V float64 tensor of a real shape is large (4096 x 128256 x 8 B = 4.2 GB, twice for logits and
gradient), so the reference is computed on ``CHUNK_ELEMENTS`` logits at a time and only the error
statistics are kept. Reported per path:

- ``loss_abs_err``: ``|loss - loss_ref|``;
- ``grad_max_abs_err``: ``max |g - g_ref|`` over every element;
- ``grad_rel_err``: ``||g - g_ref||_2 / ||g_ref||_2`` over the whole gradient.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 22  # 32 MiB per float64 chunk


class ErrorStats:
    """Accumulates the error of a gradient against its reference over chunks."""

    def __init__(self) -> None:
        self.max_abs, self.diff_sq, self.ref_sq = 0.0, 0.0, 0.0

    def add(self, grad: torch.Tensor, ref: torch.Tensor) -> None:
        diff = grad.double() - ref
        self.max_abs = max(self.max_abs, float(diff.abs().max())) if diff.numel() else self.max_abs
        self.diff_sq += float(diff.square().sum())
        self.ref_sq += float(ref.square().sum())

    def rel(self) -> float:
        if self.ref_sq == 0.0:
            return 0.0 if self.diff_sq == 0.0 else math.inf
        return math.sqrt(self.diff_sq / self.ref_sq)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor,
                  grad: torch.Tensor, ignore_index: int = -100) -> dict:
    """Compare a mean cross-entropy ``loss`` and its ``grad`` (BT, V) on ``logits`` (BT, V) with
    ``F.cross_entropy`` in float64 (the logits' own values, upcast: this measures the loss
    implementation, not the rounding of the logits to their dtype).

    The reference gradient of the mean is, per chunk, autograd of the chunk's sum divided by the number
    of non-ignored rows. No non-ignored row: reference loss 0 and gradient 0 (the contract; torch: NaN).
    """
    n_valid = int((target != ignore_index).sum())
    step = max(1, CHUNK_ELEMENTS // max(1, logits.shape[1]))
    total, stats = 0.0, ErrorStats()
    for start in range(0, logits.shape[0], step):
        rows = slice(start, start + step)
        x = logits[rows].detach().double().requires_grad_(True)
        chunk_sum = F.cross_entropy(x, target[rows], ignore_index=ignore_index, reduction="sum")
        (ref,) = torch.autograd.grad(chunk_sum, x)
        total += float(chunk_sum.detach())
        stats.add(grad[rows], ref / max(n_valid, 1))
    loss_ref = total / n_valid if n_valid else 0.0
    return {
        "loss": float(loss), "loss_ref": loss_ref, "loss_abs_err": abs(float(loss) - loss_ref),
        "grad_max_abs_err": stats.max_abs, "grad_rel_err": stats.rel(), "scored_rows": n_valid,
    }
