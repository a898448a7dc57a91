"""Float64 references for the bench, compared chunk by chunk.

A BT x V float64 tensor of a real shape is large (4096 x 128256 x 8 B = 4.2 GB, twice for logits and
gradient), so the reference is computed on ``CHUNK_ELEMENTS`` logits at a time (``LINEAR_CHUNK_ELEMENTS``
for the linear op, whose every chunk also costs a V x H weight-gradient update) and only the error
statistics are kept. Reported per path:

- ``loss_abs_err``: ``|loss - loss_ref|``;
- ``grad_max_abs_err``: ``max |g - g_ref|`` over every element (of every leaf);
- ``grad_rel_err``: ``||g - g_ref||_2 / ||g_ref||_2`` over the whole gradient (the worst leaf; per leaf
  in ``grads``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 22         # 32 MiB per float64 chunk
LINEAR_CHUNK_ELEMENTS = 1 << 24  # 128 MiB per float64 chunk of logits (341 rows at V = 49152)


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


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         loss: torch.Tensor, grads: dict, ignore_index: int = -100) -> dict:
    """Compare a mean ``loss`` of ``hidden`` (BT, H) @ ``weight`` (V, H).T and its gradients
    ``grads["hidden"]`` (BT, H), ``grads["weight"]`` (V, H) with ``F.cross_entropy(F.linear(h, W))``
    in float64 on the tensors' own values, upcast.

    Per chunk of rows, autograd of the chunk's summed loss gives the chunk's hidden gradient and its
    share of the weight gradient (accumulated in float64, V x H). Ignored rows are left out of the
    matmuls: ``F.cross_entropy`` gives them zero loss and zero gradient, so their reference hidden
    gradient is 0 and the path's hidden gradient there is compared with 0.
    """
    n_valid = int((target != ignore_index).sum())
    denominator = max(n_valid, 1)
    weight64 = weight.detach().double().requires_grad_(True)
    ref_weight = torch.zeros_like(weight64)
    step = max(1, LINEAR_CHUNK_ELEMENTS // max(1, weight.shape[0]))
    total, stats_h = 0.0, ErrorStats()
    valid = (target != ignore_index).nonzero().squeeze(1)
    ignored = (target == ignore_index).nonzero().squeeze(1)
    grad_h = grads["hidden"]
    for start in range(0, valid.shape[0], step):
        rows = valid[start:start + step]
        x = hidden.detach()[rows].double().requires_grad_(True)
        chunk_sum = F.cross_entropy(F.linear(x, weight64), target[rows], reduction="sum")
        ref_x, ref_w = torch.autograd.grad(chunk_sum, (x, weight64))
        total += float(chunk_sum.detach())
        ref_weight += ref_w
        stats_h.add(grad_h[rows], ref_x / denominator)
    if ignored.numel():
        stats_h.add(grad_h[ignored], torch.zeros(ignored.shape[0], hidden.shape[1], dtype=torch.float64,
                                                 device=hidden.device))
    stats_w, w_step = ErrorStats(), max(1, CHUNK_ELEMENTS // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], w_step):
        rows = slice(start, start + w_step)
        stats_w.add(grads["weight"][rows], ref_weight[rows] / denominator)
    loss_ref = total / n_valid if n_valid else 0.0
    per_leaf = {name: {"max_abs_err": s.max_abs, "rel_err": s.rel()}
                for name, s in (("hidden", stats_h), ("weight", stats_w))}
    return {
        "loss": float(loss), "loss_ref": loss_ref, "loss_abs_err": abs(float(loss) - loss_ref),
        "grad_max_abs_err": max(s["max_abs_err"] for s in per_leaf.values()),
        "grad_rel_err": max(s["rel_err"] for s in per_leaf.values()), "grads": per_leaf,
        "scored_rows": n_valid,
    }
