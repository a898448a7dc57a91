"""``cross_entropy_rows``: the PyTorch backend's cross-entropy as an autograd Function over the row-chunk
loops of ``cross_entropy.py``, each called as one custom op (``custom_ops.py``: one graph node under
torch.compile, whatever the number of chunks)."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.core.options import LossOptions
from .launch import class_weights
from .custom_ops import rows_grad_, rows_loss


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, opts: LossOptions, inplace_backward: bool, stats: bool):
        w, weight_sum = class_weights(weight)
        loss, lse, lse_lo, predicted = rows_loss(logits, target, w, weight_sum, opts, stats)
        if predicted is None:
            predicted = torch.empty(0, dtype=torch.int64, device=logits.device)
        ctx.save_for_backward(logits, target, lse, lse_lo, w, weight_sum)
        ctx.opts, ctx.inplace, ctx.consumed = opts, inplace_backward, False
        ctx.mark_non_differentiable(lse_lo, predicted)
        return loss, lse, lse_lo, predicted

    @staticmethod
    @backward_formula
    def backward(ctx, grad_row, grad_lse, _grad_lse_lo, _grad_pred):
        check_backward_allowed(ctx, "fusedce.cross_entropy")
        logits, target, lse, lse_lo, w, weight_sum = ctx.saved_tensors
        if grad_row is None:
            grad_row = lse.new_zeros(()).expand(lse.shape)
        out = None if ctx.inplace else torch.empty_like(logits)
        grad = rows_grad_(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, ctx.opts, out=out)
        ctx.consumed = ctx.inplace
        return grad, None, None, None, None, None


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                       opts: LossOptions, inplace_backward: bool = False, stats: bool = True):
    """Per-row ``(loss, lse, lse_lo, predicted)`` of ``logits`` (BT, V) against ``target`` (BT,): fp32 (BT,) each
    (0 on ignored rows; loss and lse differentiable), predicted int64 or empty without ``stats``;
    ``inplace_backward``: the gradient written into ``logits``' storage."""
    return _ChunkedCrossEntropy.apply(logits, target, weight, opts, inplace_backward, stats)
