"""Autograd Function around the Triton launches (per-row loss; the reduction is applied outside)."""
from __future__ import annotations

from typing import Optional

import torch

from ...types import LossOptions
from .launch import ce_backward, ce_forward


def _weights(weight: Optional[torch.Tensor]):
    if weight is None:
        return None, None
    return weight.contiguous(), weight.float().sum().reshape(1)


class TritonCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, opts: LossOptions, inplace_backward: bool, stats: bool):
        n_rows = logits.shape[0]
        w, w_sum = _weights(weight)
        loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(loss)
        predicted = torch.empty(n_rows, dtype=torch.int64, device=logits.device) if stats else None
        ce_forward(logits, target, w, w_sum, opts, loss, lse, predicted)
        ctx.save_for_backward(logits, target, w, w_sum, lse)
        ctx.opts, ctx.inplace = opts, inplace_backward
        if predicted is None:
            predicted = torch.empty(0, dtype=torch.int64, device=logits.device)
        ctx.mark_non_differentiable(lse, predicted)
        return loss, lse, predicted

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse, _grad_predicted):
        logits, target, w, w_sum, lse = ctx.saved_tensors
        grad = logits if ctx.inplace else torch.empty_like(logits)
        ce_backward(logits, target, w, w_sum, lse, grad_loss, ctx.opts, grad)
        return grad, None, None, None, None, None


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                       opts: LossOptions, inplace_backward: bool = False, stats: bool = True):
    """Per-row loss of ``logits`` ((BT, V), last-dim stride 1) against ``target`` ((BT,)).

    Returns ``(loss (BT,) fp32 with grad, lse (BT,) fp32, predicted (BT,) int64 or empty if not stats)``.
    """
    return TritonCrossEntropy.apply(logits, target, weight, opts, inplace_backward, stats)
