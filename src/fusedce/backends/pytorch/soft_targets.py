"""Probability ("soft") targets in PyTorch: the row math, its chunk loops as torch custom ops
(namespace ``fusedce_torch``: one graph node each under torch.compile, as ``custom_ops.py``) and the
autograd Function behind ``soft_cross_entropy_rows``.

Per row, on ``z`` (``row_math.transform``: logit scale, softcap), with the target ``q`` (any float dtype,
used in fp32), ``eps`` = label_smoothing, ``w`` the class weights (1 without) and ``p = softmax(z)``
(``F.cross_entropy``'s probability-target semantics; its smoothing mixes ``q`` with the uniform
distribution first):

    q'_c = (1 - eps) q_c + eps / V,   u_c = w_c q'_c,   A = sum_c u_c
    loss = sum_c u_c (lse - z_c)                                   (= -sum_c w_c q'_c log p_c)
    dL/dz_c = g (A p_c - u_c) + h p_c                              (g, h: upstream of loss, lse)

A column with ``u_c = 0`` adds exactly 0 to the loss (a -inf logit where ``q_c = 0`` is not ``0 * inf``,
where torch's composition gives NaN); every term of the sum is >= 0 for ``q >= 0`` (no cancellation).
``q`` is not required to sum to 1 (torch does not check either): ``A`` carries its mass.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...autograd_checks import check_backward_allowed
from ...options import LossOptions
from .launch import Scratch, class_weights
from ...row_math import logsumexp_rows, transform
from .tuning import chunk_rows

Opt = Optional[torch.Tensor]
Tensor = torch.Tensor


def mixed_target(q: Tensor, weight: Opt, opts: LossOptions) -> Tensor:
    """``u = w * ((1 - eps) q + eps / V)`` of a block of targets ``q`` ((n, V) any float dtype), a new
    fp32 (n, V) tensor (never ``q`` itself)."""
    eps = opts.label_smoothing
    u = q.float() * (1.0 - eps) + eps / q.shape[1] if eps > 0.0 else q.to(torch.float32, copy=True)
    return u if weight is None else u.mul_(weight)


def soft_rows_forward(x: Tensor, q: Tensor, weight: Opt, opts: LossOptions, stats: bool, scratch: Opt = None):
    """``(loss, lse, lse_lo, a, predicted)`` of fp32 logits ``x`` and targets ``q`` ((n, V)): fp32 (n,)
    each (``a`` = A above), predicted the int64 argmax of ``x`` (lowest index on ties) or None."""
    z = transform(x, opts)
    lse, lse_lo = logsumexp_rows(z, scratch)
    u = mixed_target(q, weight, opts)
    nll = torch.sub(lse[:, None], z, out=scratch).add_(lse_lo[:, None])   # -log p, exact near the max
    loss = torch.where(u == 0.0, 0.0, nll.mul_(u)).sum(dim=1)
    return loss, lse, lse_lo, u.sum(dim=1), x.argmax(dim=1) if stats else None


def soft_rows_grad(x: Tensor, q: Tensor, weight: Opt, lse: Tensor, lse_lo: Tensor, a: Tensor, grad_row: Tensor,
                   grad_lse: Opt, opts: LossOptions, out: Tensor) -> Tensor:
    """``dL/dx`` of fp32 logits ``x`` ((n, V)) into ``out`` (fp32 (n, V), may be ``x``): ``(g A + h) p -
    g u``, times ``dz/dx``; exactly 0 where ``p = u = 0``."""
    z = transform(x, opts)
    g = grad_row.float()
    factor = g * a if grad_lse is None else g * a + grad_lse.float()
    u = mixed_target(q, weight, opts).mul_(g[:, None])
    grad = torch.sub(z, lse[:, None], out=out).sub_(lse_lo[:, None]).exp_().mul_(factor[:, None]).sub_(u)
    if opts.softcap is not None:
        grad.mul_(z.div(opts.softcap).square_().neg_().add_(1.0))
    if opts.logit_scale != 1.0:
        grad.mul_(opts.logit_scale)
    return grad


def soft_chunk_loss(logits: Tensor, q: Tensor, w: Opt, opts: LossOptions, stats: bool):
    """Per-row ``(loss, lse, lse_lo, a, predicted)`` of ``logits`` / ``q`` ((n, V)) in row chunks
    (``tuning.chunk_rows``), fp32 temporaries of one chunk at a time; predicted None without stats."""
    n_rows, n_classes = logits.shape
    out = [logits.new_empty(n_rows, dtype=torch.float32) for _ in range(4)]
    predicted = logits.new_empty(n_rows, dtype=torch.int64) if stats else None
    step = min(chunk_rows(n_classes), max(n_rows, 1))
    scratch = Scratch(step, n_classes, logits.dtype, logits.device)
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        block = scratch.upcast(logits[rows])
        res = soft_rows_forward(block, q[rows], w, opts, stats, scratch.work(block.shape[0]))
        for dst, src in zip(out, res):
            dst[rows] = src
        if stats:
            predicted[rows] = res[4]
    return (*out, predicted)


def soft_chunk_grad_(logits: Tensor, q: Tensor, w: Opt, lse: Tensor, lse_lo: Tensor, a: Tensor, grad_row: Tensor,
                     grad_lse: Opt, opts: LossOptions, out: Opt = None) -> Tensor:
    """Write the gradient into ``out`` (default ``logits`` itself), chunk by chunk."""
    out = logits if out is None else out
    n_rows, n_classes = logits.shape
    step = min(chunk_rows(n_classes), max(n_rows, 1))
    scratch = None if out.dtype == torch.float32 else Scratch(step, n_classes, logits.dtype, logits.device)
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        dst = out[rows]
        block = logits[rows] if scratch is None else scratch.upcast(logits[rows])
        grad = soft_rows_grad(block, q[rows], w, lse[rows], lse_lo[rows], a[rows], grad_row[rows],
                              None if grad_lse is None else grad_lse[rows], opts,
                              dst if scratch is None else scratch.work(dst.shape[0]))
        if grad is not dst:
            dst.copy_(grad)
    return out


# ---------------------------------------------------------------- the loops as custom ops

@torch.library.custom_op("fusedce_torch::soft_chunk_loss", mutates_args=())
def _soft_loss_op(logits: Tensor, q: Tensor, w: Opt, ignore_index: int, scalars: list[float], stats: bool
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    *rows, predicted = soft_chunk_loss(logits, q, w, LossOptions.from_op_args(ignore_index, scalars), stats)
    return (*rows, logits.new_empty(0, dtype=torch.int64) if predicted is None else predicted)


@_soft_loss_op.register_fake
def _(logits, q, w, ignore_index, scalars, stats):
    n = logits.shape[0]
    return (*(logits.new_empty(n, dtype=torch.float32) for _ in range(4)),
            logits.new_empty(n if stats else 0, dtype=torch.int64))


@torch.library.custom_op("fusedce_torch::soft_chunk_grad_inplace", mutates_args=("logits",))
def _soft_grad_inplace(logits: Tensor, q: Tensor, w: Opt, lse: Tensor, lse_lo: Tensor, a: Tensor, grad_row: Tensor,
                       grad_lse: Opt, ignore_index: int, scalars: list[float]) -> None:
    soft_chunk_grad_(logits, q, w, lse, lse_lo, a, grad_row, grad_lse, LossOptions.from_op_args(ignore_index, scalars))


@_soft_grad_inplace.register_fake
def _(logits, q, w, lse, lse_lo, a, grad_row, grad_lse, ignore_index, scalars):
    return None


@torch.library.custom_op("fusedce_torch::soft_chunk_grad", mutates_args=())
def _soft_grad(logits: Tensor, q: Tensor, w: Opt, lse: Tensor, lse_lo: Tensor, a: Tensor, grad_row: Tensor,
               grad_lse: Opt, ignore_index: int, scalars: list[float]) -> Tensor:
    out = torch.empty_like(logits)
    return soft_chunk_grad_(logits, q, w, lse, lse_lo, a, grad_row, grad_lse,
                            LossOptions.from_op_args(ignore_index, scalars), out)


@_soft_grad.register_fake
def _(logits, q, w, lse, lse_lo, a, grad_row, grad_lse, ignore_index, scalars):
    return torch.empty_like(logits)


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, q, weight, opts: LossOptions, inplace_backward: bool, stats: bool):
        w, _ = class_weights(weight)
        loss, lse, lse_lo, a, predicted = torch.ops.fusedce_torch.soft_chunk_loss(logits, q, w, *opts.op_args(),
                                                                                  stats)
        ctx.save_for_backward(logits, q, w, lse, lse_lo, a)
        ctx.opts, ctx.inplace, ctx.consumed = opts, inplace_backward, False
        ctx.mark_non_differentiable(lse_lo, predicted)
        return loss, lse, lse_lo, predicted

    @staticmethod
    def backward(ctx, grad_row, grad_lse, _grad_lse_lo, _grad_pred):
        check_backward_allowed(ctx, "fusedce.cross_entropy")
        logits, q, w, lse, lse_lo, a = ctx.saved_tensors
        if grad_row is None:
            grad_row = lse.new_zeros(()).expand(lse.shape)
        args = (logits, q, w, lse, lse_lo, a, grad_row, grad_lse, *ctx.opts.op_args())
        if ctx.inplace:
            torch.ops.fusedce_torch.soft_chunk_grad_inplace(*args)
            ctx.consumed, grad = True, logits
        else:
            grad = torch.ops.fusedce_torch.soft_chunk_grad(*args)
        return grad, None, None, None, None, None


def soft_cross_entropy_rows(logits: Tensor, q: Tensor, weight: Opt, opts: LossOptions,
                            inplace_backward: bool = False, stats: bool = True):
    """Per-row loss of ``logits`` ((BT, V), last-dim stride 1) against probability targets ``q`` ((BT, V)
    any float dtype, last-dim stride 1; a constant: no gradient).

    Returns ``(loss, lse, lse_lo, predicted)`` as ``cross_entropy_rows`` (no row is ignored; predicted
    the argmax of ``logits``, empty without ``stats``); loss and lse differentiable w.r.t. ``logits``.
    With ``inplace_backward`` the backward overwrites ``logits`` with the gradient.
    """
    return _SoftCrossEntropy.apply(logits, q, weight, opts, inplace_backward, stats)
