"""Probability ("soft") targets on the Triton backend: the launches as torch custom ops (namespace
``fusedce``, fake impls, so ``torch.compile(fullgraph=True)`` traces them), their autograd formula, and
the backend interface ``soft_cross_entropy_rows``.

- ``fusedce::soft_ce_forward(logits, q, weight?, <options>, stats, inplace_backward)
  -> (loss, lse, lse_lo, a, predicted)``: (BT,) fp32 each (``a`` = sum_c w_c q'_c, saved for the
  backward), predicted (BT,) int64 or (0,) without ``stats``. Differentiable outputs: loss and lse.
- ``fusedce::soft_ce_backward(logits, q, weight?, lse, lse_lo, a, grad_row, grad_lse?, <options>) -> grad``
  (a new (BT, V) buffer, logits' dtype) and ``fusedce::soft_ce_backward_inplace(logits!, ...)`` (writes
  the gradient into ``logits``; returns nothing, the formula hands ``logits`` back), as the class-index
  ops of ``custom_ops.py``.
``<options>`` = ``ignore_index: int, scalars: float[]`` (``LossOptions.op_args``). ``q`` is a constant:
no gradient reaches it.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...autograd_checks import check_backward_allowed
from ...options import LossOptions
from .soft_launch import soft_backward, soft_forward

Opt = Optional[torch.Tensor]
Tensor = torch.Tensor


def _unit_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _opt_contiguous(t: Opt) -> Opt:
    return None if t is None else t.contiguous()


def _buffers(logits: Tensor, stats: bool):
    n = logits.shape[0]
    return (*(logits.new_empty(n, dtype=torch.float32) for _ in range(4)),
            logits.new_empty(n if stats else 0, dtype=torch.int64))


@torch.library.custom_op("fusedce::soft_ce_forward", mutates_args=())
def soft_ce_forward(logits: Tensor, q: Tensor, weight: Opt, ignore_index: int, scalars: list[float], stats: bool,
                    inplace_backward: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # ``inplace_backward`` does not change the forward: the autograd formula reads it
    loss, lse, lse_lo, a, predicted = _buffers(logits, stats)
    soft_forward(_unit_stride(logits), _unit_stride(q), _opt_contiguous(weight),
                 LossOptions.from_op_args(ignore_index, scalars), loss, lse, lse_lo, a, predicted if stats else None)
    return loss, lse, lse_lo, a, predicted


@soft_ce_forward.register_fake
def _(logits, q, weight, ignore_index, scalars, stats, inplace_backward):
    return _buffers(logits, stats)


@torch.library.custom_op("fusedce::soft_ce_backward", mutates_args=())
def soft_ce_backward(logits: Tensor, q: Tensor, weight: Opt, lse: Tensor, lse_lo: Tensor, a: Tensor,
                     grad_row: Tensor, grad_lse: Opt, ignore_index: int, scalars: list[float]) -> Tensor:
    grad = logits.new_empty(logits.shape)
    soft_backward(_unit_stride(logits), _unit_stride(q), _opt_contiguous(weight), lse.contiguous(),
                  lse_lo.contiguous(), a.contiguous(), grad_row, grad_lse,
                  LossOptions.from_op_args(ignore_index, scalars), grad)
    return grad


@soft_ce_backward.register_fake
def _(logits, q, weight, lse, lse_lo, a, grad_row, grad_lse, ignore_index, scalars):
    return logits.new_empty(logits.shape)


@torch.library.custom_op("fusedce::soft_ce_backward_inplace", mutates_args=("logits",))
def soft_ce_backward_inplace(logits: Tensor, q: Tensor, weight: Opt, lse: Tensor, lse_lo: Tensor, a: Tensor,
                             grad_row: Tensor, grad_lse: Opt, ignore_index: int, scalars: list[float]) -> None:
    rows = _unit_stride(logits)   # each program reads its block before writing it: aliasing is safe
    soft_backward(rows, _unit_stride(q), _opt_contiguous(weight), lse.contiguous(), lse_lo.contiguous(),
                  a.contiguous(), grad_row, grad_lse, LossOptions.from_op_args(ignore_index, scalars), rows)
    if rows is not logits:
        logits.copy_(rows)


@soft_ce_backward_inplace.register_fake
def _(logits, q, weight, lse, lse_lo, a, grad_row, grad_lse, ignore_index, scalars):
    return None


# ---------------------------------------------------------------- autograd formula on soft_ce_forward

def _setup_context(ctx, inputs, output):
    logits, q, weight, ignore_index, scalars, _stats, inplace_backward = inputs
    _loss, lse, lse_lo, a, predicted = output
    ctx.save_for_backward(logits, q, weight, lse, lse_lo, a)
    ctx.options, ctx.inplace, ctx.consumed = (ignore_index, scalars), inplace_backward, False
    ctx.mark_non_differentiable(lse_lo, a, predicted)


def _backward(ctx, grad_row, grad_lse, _grad_lse_lo, _grad_a, _grad_predicted):
    """For the upstream per-row gradients of ``loss`` and ``lse`` (any strides; None when that output
    took no part in the graph)."""
    check_backward_allowed(ctx, "fusedce.cross_entropy")
    logits, q, weight, lse, lse_lo, a = ctx.saved_tensors
    if grad_row is None:
        grad_row = lse.new_zeros(()).expand(lse.shape)
    args = (logits, q, weight, lse, lse_lo, a, grad_row, grad_lse, *ctx.options)
    if ctx.inplace:
        torch.ops.fusedce.soft_ce_backward_inplace(*args)
        ctx.consumed, grad = True, logits
    else:
        grad = torch.ops.fusedce.soft_ce_backward(*args)
    return grad, None, None, None, None, None, None


torch.library.register_autograd("fusedce::soft_ce_forward", _backward, setup_context=_setup_context)


def soft_cross_entropy_rows(logits: Tensor, q: Tensor, weight: Opt, opts: LossOptions,
                            inplace_backward: bool = False, stats: bool = True):
    """Per-row loss of ``logits`` ((BT, V), last-dim stride 1) against probability targets ``q`` ((BT, V),
    any float dtype; a constant).

    Returns ``(loss, lse, lse_lo, predicted)`` as ``cross_entropy_rows`` (no row is ignored; predicted
    the argmax of ``logits``, (0,) without ``stats``); loss and lse are differentiable w.r.t. ``logits``.
    With ``inplace_backward`` the backward writes the gradient into ``logits``' storage.
    """
    loss, lse, lse_lo, _a, predicted = torch.ops.fusedce.soft_ce_forward(
        logits, q, None if weight is None else weight, *opts.op_args(), stats, inplace_backward)
    return loss, lse, lse_lo, predicted
