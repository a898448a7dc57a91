"""Autograd for the CuTe cross-entropy kernels, and the backend interface ``cross_entropy_rows``.

Layering: kernels/*.py -> launch.py (into given buffers) -> this file (allocate + autograd Function;
per-row loss only, the reduction is applied by ``functional``). Unlike the Triton backend these are
not registered as torch custom ops yet: under ``torch.compile`` the Function is a graph break.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...autograd_checks import check_backward_allowed
from ...types import LossOptions
from . import launch


class _CuteCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, weight_sum, opts, stats, inplace_backward):
        rows = logits if logits.stride(-1) == 1 or logits.shape[-1] <= 1 else logits.contiguous()
        n = logits.shape[0]
        new = lambda dtype=torch.float32: logits.new_empty(n, dtype=dtype)   # noqa: E731
        loss, lse, lse_lo = new(), new(), new()
        predicted = new(torch.int64) if stats else logits.new_empty(0, dtype=torch.int64)
        launch.ce_forward(rows, target, weight, weight_sum, opts, loss, lse, lse_lo, predicted if stats else None)
        ctx.save_for_backward(logits, target, weight, weight_sum, lse, lse_lo)
        ctx.opts, ctx.inplace, ctx.consumed = opts, inplace_backward, False
        ctx.mark_non_differentiable(lse_lo, predicted)
        return loss, lse, lse_lo, predicted

    @staticmethod
    def backward(ctx, grad_row, grad_lse, _grad_lse_lo, _grad_predicted):
        check_backward_allowed(ctx, "fusedce.cross_entropy")
        logits, target, weight, weight_sum, lse, lse_lo = ctx.saved_tensors
        if grad_row is None:
            grad_row = lse.new_zeros(()).expand(lse.shape)
        rows = logits if logits.stride(-1) == 1 or logits.shape[-1] <= 1 else logits.contiguous()
        if ctx.inplace and rows is logits:
            grad = logits                   # each vector is read before it is written: aliasing is safe
            ctx.consumed = True
        else:
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        launch.ce_backward(rows, target, weight, weight_sum, lse, lse_lo, grad_row, grad_lse, ctx.opts, grad)
        return grad, None, None, None, None, None, None


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                       opts: LossOptions, inplace_backward: bool = False, stats: bool = True):
    """Per-row loss of ``logits`` ((BT, V), CUDA) against ``target`` ((BT,)): ``(loss, lse, lse_lo,
    predicted)`` as the Triton backend's (``backends/__init__.py``)."""
    weight_sum = None if weight is None else weight.float().sum().reshape(1)
    return _CuteCrossEntropy.apply(logits, target, weight, weight_sum, opts, stats, inplace_backward)
