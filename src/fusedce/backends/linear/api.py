"""Autograd Function and compaction around the chunk loop (``loop.py``).

- mean / sum: the forward computes the loss and every gradient chunk by chunk with the per-row upstream
  gradient ``scale`` (1/D or 1) already applied; backward only multiplies the saved gradients by the
  scalar upstream gradient (a device tensor: no sync, no recompute).
- none: the forward computes only the loss (and lse); backward recomputes each chunk's logits and takes
  the per-token upstream gradient exactly. Extra cost: one more logits matmul, 2 * BT * V * H FLOPs
  (+50% of the forward-with-gradient matmul FLOPs), instead of holding BT x V of anything.
- Ignored rows are dropped before the matmuls (``index_select`` of the non-ignored rows; one host sync
  per call for their count), so they cost no FLOPs; their loss is 0 and their hidden gradient exactly 0.
  Under torch.compile or CUDA-graph capture there is no compaction: all rows go through the kernels,
  which give ignored rows zero loss and zero gradient.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from ...types import LossOptions
from ...validation import sync_allowed
from . import loop
from .tuning import chunk_rows


class ChunkCE(Protocol):
    """A backend's cross-entropy on one chunk of logits ((n, V), contiguous, owned by the loop)."""

    def loss(self, logits, target, w, w_sum, opts: LossOptions, stats: bool): ...

    def grad_(self, logits, target, w, w_sum, lse, grad_row, opts: LossOptions) -> None: ...


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ce, w, w_sum, opts, reduction, scale, rows,
                accum_dtype, stats, needs):
        if reduction == "none":
            loss, lse, predicted = loop.loss_only(ce, hidden, weight, bias, target, w, w_sum, opts, rows, stats)
            ctx.save_for_backward(hidden, weight, bias, target, w, w_sum, lse)
            out = loss
        else:
            grad_row = scale.expand(hidden.shape[0])
            loss, lse, predicted, *ctx.grads = loop.grads(
                ce, hidden, weight, bias, target, w, w_sum, opts, rows, grad_row, needs, accum_dtype,
                stats=stats)
            out = loss.sum() * scale if reduction == "mean" else loss.sum()
        ctx.ce, ctx.opts, ctx.rows, ctx.accum, ctx.needs, ctx.reduction = ce, opts, rows, accum_dtype, needs, reduction
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(lse, predicted)
        return out, lse, predicted

    @staticmethod
    def backward(ctx, grad_out, _grad_lse, _grad_pred):
        if ctx.reduction == "none":
            hidden, weight, bias, target, w, w_sum, lse = ctx.saved_tensors
            *_, g_h, g_w, g_b = loop.grads(ctx.ce, hidden, weight, bias, target, w, w_sum, ctx.opts,
                                           ctx.rows, grad_out, ctx.needs, ctx.accum, lse=lse)
        else:
            if ctx.grads is None:
                raise RuntimeError("linear_cross_entropy's backward (mean/sum) can run once: its gradients "
                                   "are computed in forward and scaled in place")
            (g_h, g_w, g_b), ctx.grads = ctx.grads, None
            g = grad_out.float()   # scale in place: no second V x H buffer
            g_h, g_w, g_b = (None if t is None else t.mul_(g) for t in (g_h, g_w, g_b))
        g_w = None if g_w is None else g_w.to(ctx.dtypes[1])
        g_b = None if g_b is None else g_b.to(ctx.dtypes[2])
        return (g_h, g_w, g_b) + (None,) * 11


def _scatter(values: torch.Tensor, index: Optional[torch.Tensor], n: int, fill) -> torch.Tensor:
    if index is None:
        return values
    out = torch.full((n,), fill, dtype=values.dtype, device=values.device)
    return out.index_copy(0, index, values)


def linear_cross_entropy(ce: ChunkCE, hidden, weight, target, bias, ce_weight, opts: LossOptions,
                         reduction: str, scale, chunk_size, accum_dtype, stats: bool):
    """Backend entry: ``hidden`` (BT, H), ``weight`` (V, H), ``target`` (BT,) -> (loss, lse, predicted).

    ``loss`` is the reduced scalar (``scale`` = 1/D for mean) or (BT,) per-row for "none"; lse (BT,)
    fp32 is 0 on ignored rows (their logits are never computed); predicted (BT,) int64, -1 on ignored.
    """
    n = hidden.shape[0]
    w, w_sum = (None, None) if ce_weight is None else (ce_weight.float(), ce_weight.float().sum())
    valid = target != opts.ignore_index
    index = None
    if n > 0 and sync_allowed():
        index = valid.nonzero().squeeze(1)          # the documented host sync: rows worth computing
        hidden, target = hidden.index_select(0, index), target.index_select(0, index)
    rows = chunk_size or chunk_rows(hidden.shape[0], hidden.shape[1], weight.shape[0])
    scale = torch.ones((), device=hidden.device) if scale is None else scale
    needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and any(needs):
        out, lse, predicted = _LinearCE.apply(hidden, weight, bias, target, ce, w, w_sum, opts, reduction,
                                              scale, rows, accum_dtype, stats, needs)
    else:
        with torch.no_grad():
            loss, lse, predicted = loop.loss_only(ce, hidden, weight, bias, target, w, w_sum, opts, rows, stats)
        out = loss if reduction == "none" else (loss.sum() * scale if reduction == "mean" else loss.sum())
    if reduction == "none":
        out = _scatter(out, index, n, 0.0)
    lse, predicted = _scatter(lse, index, n, 0.0), _scatter(predicted, index, n, -1)
    if index is None:
        lse = torch.where(valid, lse, 0.0)
    return out, lse, predicted
