"""The CuTe launches as torch custom ops, so ``torch.compile(fullgraph=True)`` traces through them."""
from __future__ import annotations

from typing import Optional

import torch

from ..layout import unit_stride
from fusedce.core.options import LossOptions
from . import launch

Opt = Optional[torch.Tensor]


def _row_buffers(logits: torch.Tensor, stats: bool, token_scaling: bool = False):
    n = logits.shape[0]
    new = lambda k, dtype=torch.float32: logits.new_empty(k, dtype=dtype)   # noqa: E731
    return new(n), new(n), new(n), new(n if stats else 0, torch.int64), new(n if token_scaling else 0)


@torch.library.custom_op("fusedce_cute::ce_forward", mutates_args=())
def ce_forward(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt,
               ignore_index: int, scalars: list[float], stats: bool, inplace_backward: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # ``inplace_backward`` does not change the forward: the autograd formula (cross_entropy.py) reads it.
    loss, lse, lse_lo, predicted, _ = _row_buffers(logits, stats)
    launch.ce_forward(unit_stride(logits), target, weight, weight_sum, LossOptions.from_op_args(ignore_index, scalars),
                      loss, lse, lse_lo, predicted if stats else None)
    return loss, lse, lse_lo, predicted


@ce_forward.register_fake
def _(logits, target, weight, weight_sum, ignore_index, scalars, stats, inplace_backward):
    return _row_buffers(logits, stats)[:4]


@torch.library.custom_op("fusedce_cute::ce_backward", mutates_args=())
def ce_backward(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt, lse: torch.Tensor,
                lse_lo: torch.Tensor, grad_row: torch.Tensor, grad_lse: Opt, ignore_index: int,
                scalars: list[float]) -> torch.Tensor:
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    launch.ce_backward(unit_stride(logits), target, weight, weight_sum, lse, lse_lo, grad_row, grad_lse,
                       LossOptions.from_op_args(ignore_index, scalars), grad)
    return grad


@ce_backward.register_fake
def _(logits, target, weight, weight_sum, lse, lse_lo, grad_row, grad_lse, ignore_index, scalars):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


@torch.library.custom_op("fusedce_cute::ce_backward_inplace", mutates_args=("logits",))
def ce_backward_inplace(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt,
                        lse: torch.Tensor, lse_lo: torch.Tensor, grad_row: torch.Tensor, grad_lse: Opt,
                        ignore_index: int, scalars: list[float]) -> None:
    rows = unit_stride(logits)   # each vector is read before it is written: aliasing is safe
    launch.ce_backward(rows, target, weight, weight_sum, lse, lse_lo, grad_row, grad_lse,
                       LossOptions.from_op_args(ignore_index, scalars), rows)
    if rows is not logits:
        logits.copy_(rows)


@ce_backward_inplace.register_fake
def _(logits, target, weight, weight_sum, lse, lse_lo, grad_row, grad_lse, ignore_index, scalars):
    return None


@torch.library.custom_op("fusedce_cute::ce_chunk_", mutates_args=("logits",))
def ce_chunk_(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt, grad_row: torch.Tensor,
              z_grad_row: torch.Tensor, ignore_index: int, scalars: list[float], stats: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    opts = LossOptions.from_op_args(ignore_index, scalars)
    loss, lse, lse_lo, predicted, token_weight = _row_buffers(logits, stats, opts.use_token_scaling)
    rows = unit_stride(logits)
    launch.ce_chunk_(rows, target, weight, weight_sum, grad_row, z_grad_row, opts, loss, lse, lse_lo,
                     predicted if stats else None, token_weight if opts.use_token_scaling else None)
    if rows is not logits:
        logits.copy_(rows)
    return loss, lse, lse_lo, predicted, token_weight


@ce_chunk_.register_fake
def _(logits, target, weight, weight_sum, grad_row, z_grad_row, ignore_index, scalars, stats):
    return _row_buffers(logits, stats, LossOptions.from_op_args(ignore_index, scalars).use_token_scaling)
