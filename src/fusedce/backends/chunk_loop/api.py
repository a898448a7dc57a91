"""Autograd Function and compaction around the chunk loop (``loop.py``).

- mean / sum: the forward computes the loss and every gradient chunk by chunk with the per-row upstream
  gradients already applied (``1/D`` for the cross-entropy and ``1/N`` for the z-loss with mean, 1 with
  sum); the first backward only multiplies the saved gradients by the scalar upstream gradient (a
  device tensor: no sync, no recompute). A later backward through a retained graph (``retain_graph=True``,
  or ``torch.autograd.grad`` then ``backward``) recomputes them from the saved inputs, as "none" does;
  for that the Function keeps its (compacted) ``hidden`` until the graph is freed: BT' x H, a copy only
  when some rows are ignored (otherwise the caller's tensor itself).
- none: the forward computes only the loss (and lse); backward recomputes each chunk's logits and takes
  the per-token upstream gradient exactly. Extra cost: one more logits matmul, 2 * BT * V * H FLOPs
  (+50% of the forward-with-gradient matmul FLOPs), instead of holding BT x V of anything.
- Ignored rows are dropped before the matmuls (``index_select`` of the non-ignored rows; one host sync
  per call for their count; no copy at all when no row is ignored), so they cost no FLOPs; their loss
  and lse are 0 and their hidden gradient exactly 0. Under torch.compile or CUDA-graph capture there is
  no compaction: all rows go through the kernels, which give ignored rows zero loss and zero gradient.
- ``create_graph=True`` (double backward) raises ``RuntimeError``.
"""
from __future__ import annotations

import inspect
from typing import Optional, Protocol

import torch

from ...autograd_checks import check_backward_allowed
from ...reduction import MeanScales, reduce, token_scaled, z_rows
from ...types import LossOptions
from ...validation import sync_allowed
from . import loop
from .tuning import chunk_rows


class ChunkCE(Protocol):
    """A backend's cross-entropy on one chunk of logits ((n, V), contiguous, owned by the loop)."""

    def loss(self, logits, target, w, weight_sum, opts: LossOptions, stats: bool):
        """-> ``(loss, lse, lse_lo, predicted)``, (n,) each: cross-entropy without z-loss, the lse pair."""

    def grad_(self, logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, opts: LossOptions) -> None:
        """Overwrite ``logits`` with d(sum grad_row * loss + grad_lse * lse)/d logits."""

    def loss_and_grad_(self, logits, target, w, weight_sum, grad_row, z_grad_row, opts: LossOptions,
                       stats: bool):
        """``loss`` then ``grad_`` in one call (``loop.loss_then_grad_`` composes them; a backend may fuse
        them in one kernel): ``(loss, lse, lse_lo, predicted, token_weight)``, the z-loss's upstream
        ``z_grad_row`` and token scaling applied."""


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ce, w, weight_sum, opts, reduction, scale_pair, rows,
                accum_dtype, stats, needs):
        # scale_pair (2,) = (1/D, 1/N): one tensor, since the two are often the same tensor and an
        # autograd.Function may not take one tensor twice under torch.compile
        ctx.grads = None
        ce_scale, z_scale = scale_pair[0], scale_pair[1]
        scales = MeanScales(ce_scale, z_scale)
        if reduction == "none":
            loss, lse, lse_lo, predicted, token_weight = loop.loss_only(ce, hidden, weight, bias, target, w,
                                                                        weight_sum, opts, rows, stats)
        else:
            n = hidden.shape[0]
            loss, lse, lse_lo, predicted, token_weight, *ctx.grads = loop.grads(
                ce, hidden, weight, bias, target, w, weight_sum, opts, rows, scales.ce.expand(n),
                scales.z.expand(n), needs, accum_dtype, stats=stats)
        out = reduce(*token_scaled(loss, z_rows(lse, opts), token_weight), reduction, scales, loss.shape)
        if token_weight is None:
            token_weight = lse.new_empty(0)
        ctx.save_for_backward(hidden, weight, bias, target, w, weight_sum, lse, lse_lo, scale_pair)
        ctx.ce, ctx.opts, ctx.rows, ctx.accum = ce, opts, rows, accum_dtype
        ctx.needs, ctx.reduction = needs, reduction
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(lse, predicted, token_weight)
        return out, lse, predicted, token_weight

    @staticmethod
    def backward(ctx, grad_out, _grad_lse, _grad_pred, _grad_token_weight):
        check_backward_allowed(ctx, "fusedce.linear_cross_entropy")
        if ctx.grads is not None:   # the first backward of mean / sum: scale what the forward made
            (g_h, g_w, g_b), ctx.grads = ctx.grads, None
            g = grad_out.float()    # scale in place: no second V x H buffer
            g_h, g_w, g_b = (None if t is None else t.mul_(g) for t in (g_h, g_w, g_b))
        else:                       # "none", or a second backward: recompute from the saved inputs
            hidden, weight, bias, target, w, weight_sum, lse, lse_lo, scale_pair = ctx.saved_tensors
            ce_scale, z_scale = scale_pair[0], scale_pair[1]
            n = hidden.shape[0]
            if ctx.reduction == "none":
                grad_row = z_grad_row = grad_out
            else:
                g = grad_out.float()
                grad_row, z_grad_row = (ce_scale * g).expand(n), (z_scale * g).expand(n)
            *_, g_h, g_w, g_b = loop.grads(ctx.ce, hidden, weight, bias, target, w, weight_sum, ctx.opts,
                                           ctx.rows,
                                           grad_row, z_grad_row, ctx.needs, ctx.accum, saved=(lse, lse_lo))
        g_w = None if g_w is None else g_w.to(ctx.dtypes[1])
        g_b = None if g_b is None else g_b.to(ctx.dtypes[2])
        return (g_h, g_w, g_b) + (None,) * (_N_INPUTS - 3)


_N_INPUTS = len(inspect.signature(_LinearCE.forward).parameters) - 1   # forward's inputs, ctx excluded


def _scatter(values: torch.Tensor, index: Optional[torch.Tensor], n: int, fill) -> torch.Tensor:
    if index is None:
        return values
    out = torch.full((n,), fill, dtype=values.dtype, device=values.device)
    return out.index_copy(0, index, values)


def compact_rows(hidden: torch.Tensor, target: torch.Tensor, ignore_index: int):
    """``(hidden, target, index)``: the non-ignored rows and their positions, or the inputs and None
    when no row is ignored, under torch.compile / CUDA-graph capture (no host sync allowed), or for an
    empty batch. The one documented host sync of the linear ops (the count of kept rows)."""
    if hidden.shape[0] == 0 or not sync_allowed():
        return hidden, target, None
    index = (target != ignore_index).nonzero().squeeze(1)
    if index.shape[0] == hidden.shape[0]:
        return hidden, target, None
    return hidden.index_select(0, index), target.index_select(0, index), index


def linear_cross_entropy(ce: ChunkCE, hidden, weight, target, bias, ce_weight, opts: LossOptions,
                         reduction: str, scales: Optional[MeanScales], chunk_size, accum_dtype, stats: bool):
    """Backend entry: ``hidden`` (BT, H), ``weight`` (V, H), ``target`` (BT,) -> (loss, lse, predicted,
    token_weight).

    ``loss`` is the reduced scalar (``scales`` = the mean's 1/D and 1/N for "mean", None otherwise) or
    (BT,) per-row for "none"; lse (BT,) fp32 is 0 on ignored rows (their logits are never computed);
    predicted (BT,) int64, -1 on ignored rows; token_weight (BT,) fp32 ``p_t`` with
    ``use_token_scaling`` (0 on ignored rows), else None.
    """
    n = hidden.shape[0]
    w, weight_sum = (None, None) if ce_weight is None else (ce_weight.float(), ce_weight.float().sum())
    hidden, target, index = compact_rows(hidden, target, opts.ignore_index)
    rows = chunk_size or chunk_rows(hidden.shape[0], hidden.shape[1], weight.shape[0])
    if scales is None:
        one = torch.ones((), device=hidden.device)
        scales = MeanScales(one, one)
    needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and any(needs):
        out, lse, predicted, token_weight = _LinearCE.apply(hidden, weight, bias, target, ce, w, weight_sum,
                                                            opts,
                                                            reduction, torch.stack(scales), rows, accum_dtype,
                                                            stats, needs)
        token_weight = token_weight if opts.use_token_scaling else None
    else:
        with torch.no_grad():
            loss, lse, _lse_lo, predicted, token_weight = loop.loss_only(ce, hidden, weight, bias, target, w,
                                                                         weight_sum, opts, rows, stats)
        out = reduce(*token_scaled(loss, z_rows(lse, opts), token_weight), reduction, scales, loss.shape)
    if reduction == "none":
        out = _scatter(out, index, n, 0.0)
    if token_weight is not None:
        token_weight = _scatter(token_weight, index, n, 0.0)
    return out, _scatter(lse, index, n, 0.0), _scatter(predicted, index, n, -1), token_weight
