"""Probability ("soft") targets on the Triton backend: the launches as torch custom ops (namespace ``fusedce``, fake
impls, so ``torch.compile(fullgraph=True)`` traces them), their autograd formula, and the backend interface
``probs_cross_entropy_rows``."""
from __future__ import annotations

from typing import Optional

import torch

from ..layout import opt_contiguous, unit_stride
from fusedce.core.options import LossOptions
from ..op_autograd import register_rows_autograd
from .probs_launch import probs_backward, probs_forward

Opt = Optional[torch.Tensor]
Tensor = torch.Tensor


def _buffers(logits: Tensor, stats: bool):
    n = logits.shape[0]
    return (*(logits.new_empty(n, dtype=torch.float32) for _ in range(4)),
            logits.new_empty(n if stats else 0, dtype=torch.int64))


@torch.library.custom_op("fusedce::probs_ce_forward", mutates_args=())
def probs_ce_forward(logits: Tensor, q: Tensor, weight: Opt, ignore_index: int, scalars: list[float], stats: bool,
                    inplace_backward: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # ``inplace_backward`` does not change the forward: the autograd formula reads it
    loss, lse, lse_lo, a, predicted = _buffers(logits, stats)
    probs_forward(unit_stride(logits), unit_stride(q), opt_contiguous(weight),
                 LossOptions.from_op_args(ignore_index, scalars), loss, lse, lse_lo, a, predicted if stats else None)
    return loss, lse, lse_lo, a, predicted


@probs_ce_forward.register_fake
def _(logits, q, weight, ignore_index, scalars, stats, inplace_backward):
    return _buffers(logits, stats)


@torch.library.custom_op("fusedce::probs_ce_backward", mutates_args=())
def probs_ce_backward(logits: Tensor, q: Tensor, weight: Opt, lse: Tensor, lse_lo: Tensor, a: Tensor,
                     grad_row: Tensor, grad_lse: Opt, ignore_index: int, scalars: list[float]) -> Tensor:
    grad = logits.new_empty(logits.shape)
    probs_backward(unit_stride(logits), unit_stride(q), opt_contiguous(weight), lse.contiguous(),
                  lse_lo.contiguous(), a.contiguous(), grad_row, grad_lse,
                  LossOptions.from_op_args(ignore_index, scalars), grad)
    return grad


@probs_ce_backward.register_fake
def _(logits, q, weight, lse, lse_lo, a, grad_row, grad_lse, ignore_index, scalars):
    return logits.new_empty(logits.shape)


@torch.library.custom_op("fusedce::probs_ce_backward_inplace", mutates_args=("logits",))
def probs_ce_backward_inplace(logits: Tensor, q: Tensor, weight: Opt, lse: Tensor, lse_lo: Tensor, a: Tensor,
                             grad_row: Tensor, grad_lse: Opt, ignore_index: int, scalars: list[float]) -> None:
    rows = unit_stride(logits)   # each program reads its block before writing it: aliasing is safe
    probs_backward(rows, unit_stride(q), opt_contiguous(weight), lse.contiguous(), lse_lo.contiguous(),
                  a.contiguous(), grad_row, grad_lse, LossOptions.from_op_args(ignore_index, scalars), rows)
    if rows is not logits:
        logits.copy_(rows)


@probs_ce_backward_inplace.register_fake
def _(logits, q, weight, lse, lse_lo, a, grad_row, grad_lse, ignore_index, scalars):
    return None


register_rows_autograd("fusedce", "probs_ce")   # the formula: backends/op_autograd.py


def probs_cross_entropy_rows(logits: Tensor, q: Tensor, weight: Opt, opts: LossOptions,
                            inplace_backward: bool = False, stats: bool = True):
    """``cross_entropy_rows`` against probability targets ``q`` ((BT, V), any float dtype, a constant): no row
    ignored, ``predicted`` the argmax of ``logits``."""
    loss, lse, lse_lo, _a, predicted = torch.ops.fusedce.probs_ce_forward(
        logits, q, None if weight is None else weight, *opts.op_args(), stats, inplace_backward)
    return loss, lse, lse_lo, predicted
