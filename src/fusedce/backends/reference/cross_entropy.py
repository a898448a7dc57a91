"""Chunked cross-entropy in PyTorch: forward saves only the per-row lse, backward recomputes.

Memory: the stock path keeps an fp32 softmax (BT x V) for backward and builds fp32 temporaries of the
same size; this one holds fp32 temporaries of one chunk of rows (``tuning.chunk_rows``) at a time and
writes the gradient straight into its output (or into ``logits`` with ``inplace_backward``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ...autograd_checks import check_backward_allowed
from ...types import LossOptions
from .rows import rows_forward, rows_grad
from .tuning import chunk_rows


def class_weights(weight: Optional[torch.Tensor]):
    """(fp32 weights, their sum as a device tensor), or (None, None)."""
    if weight is None:
        return None, None
    w = weight.float()
    return w, w.sum()


def chunk_loss(logits, target, w, w_sum, opts: LossOptions, stats: bool = True):
    """Per-row ``(loss, lse, lse_lo, predicted)`` of ``logits`` ((n, V)), no gradient: fp32 (n,) each
    (cross-entropy without z-loss; lse as the pair lse + lse_lo, see ``rows.py``), predicted (n,) int64
    or None without stats."""
    n_rows, n_classes = logits.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse, lse_lo = torch.empty_like(loss), torch.empty_like(loss)
    predicted = torch.empty(n_rows, dtype=torch.int64, device=logits.device) if stats else None
    step = chunk_rows(n_classes)
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        loss[rows], lse[rows], lse_lo[rows], pred = rows_forward(
            logits[rows].float(), target[rows], w, w_sum, opts, stats)
        if stats:
            predicted[rows] = pred
    return loss, lse, lse_lo, predicted


def chunk_grad_(logits, target, w, w_sum, lse, lse_lo, grad_row, grad_lse, opts: LossOptions,
                out=None) -> torch.Tensor:
    """Write d(sum_i grad_row[i] loss_i + grad_lse[i] lse_i)/d logits into ``out`` (default:
    ``logits`` itself). ``grad_lse`` None means 0.

    In place on fp32 logits no (n, V) temporary is made besides softcap's; other dtypes upcast one row
    chunk at a time.
    """
    out = logits if out is None else out
    step = chunk_rows(logits.shape[1])
    for start in range(0, logits.shape[0], step):
        rows = slice(start, start + step)
        dst = out[rows]
        fp32 = dst.dtype == torch.float32
        grad = rows_grad(logits[rows].float(), target[rows], w, w_sum, lse[rows], lse_lo[rows], grad_row[rows],
                         None if grad_lse is None else grad_lse[rows], opts, out=dst if fp32 else None)
        if not fp32:
            dst.copy_(grad)
    return out


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, opts: LossOptions, inplace_backward: bool, stats: bool):
        w, w_sum = class_weights(weight)
        loss, lse, lse_lo, predicted = chunk_loss(logits, target, w, w_sum, opts, stats)
        if predicted is None:
            predicted = torch.empty(0, dtype=torch.int64, device=logits.device)
        ctx.save_for_backward(logits, target, lse, lse_lo, w, w_sum)
        ctx.opts, ctx.inplace, ctx.consumed = opts, inplace_backward, False
        ctx.mark_non_differentiable(predicted)
        return loss, lse, predicted

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, _grad_pred):
        check_backward_allowed(ctx, "fusedce.cross_entropy")
        logits, target, lse, lse_lo, w, w_sum = ctx.saved_tensors
        if grad_loss is None:
            grad_loss = lse.new_zeros(()).expand(lse.shape)
        out = None if ctx.inplace else torch.empty_like(logits)
        grad = chunk_grad_(logits, target, w, w_sum, lse, lse_lo, grad_loss, grad_lse, ctx.opts, out=out)
        ctx.consumed = ctx.inplace
        return grad, None, None, None, None, None


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                       opts: LossOptions, inplace_backward: bool = False, stats: bool = True):
    """Per-row loss of ``logits`` ((BT, V), last-dim stride 1) against ``target`` ((BT,)).

    Returns ``(loss (BT,) fp32, lse (BT,) fp32, predicted (BT,) int64)``: the cross-entropy without
    z-loss and the lse (0 on ignored rows), both differentiable w.r.t. ``logits``. With
    ``inplace_backward`` the backward pass overwrites ``logits`` with the gradient (a second backward
    then raises ``RuntimeError``). Without ``stats`` no argmax is computed and ``predicted`` is empty.
    """
    return _ChunkedCrossEntropy.apply(logits, target, weight, opts, inplace_backward, stats)
