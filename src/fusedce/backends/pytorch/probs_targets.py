"""Probability ("soft") targets on the PyTorch backend: the chunk loops of ``probs_launch.py`` as torch custom ops
(namespace ``fusedce_torch``: one graph node each under torch.compile, as ``custom_ops.py``), their autograd formula
(``backends/op_autograd.py``, the one the Triton backend's ops use) and the backend interface
``probs_cross_entropy_rows``."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.options import LossOptions
from ..op_autograd import register_rows_autograd
from .probs_launch import probs_chunk_grad_, probs_chunk_loss

Opt = Optional[torch.Tensor]
Tensor = torch.Tensor


def _f32(weight: Opt) -> Opt:
    return None if weight is None else weight.float()


@torch.library.custom_op("fusedce_torch::probs_ce_forward", mutates_args=())
def _probs_forward(logits: Tensor, q: Tensor, weight: Opt, ignore_index: int, scalars: list[float], stats: bool,
                  inplace_backward: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # ``inplace_backward`` does not change the forward: the autograd formula reads it
    *rows, predicted = probs_chunk_loss(logits, q, _f32(weight), LossOptions.from_op_args(ignore_index, scalars),
                                       stats)
    return (*rows, logits.new_empty(0, dtype=torch.int64) if predicted is None else predicted)


@_probs_forward.register_fake
def _(logits, q, weight, ignore_index, scalars, stats, inplace_backward):
    n = logits.shape[0]
    return (*(logits.new_empty(n, dtype=torch.float32) for _ in range(4)),
            logits.new_empty(n if stats else 0, dtype=torch.int64))


@torch.library.custom_op("fusedce_torch::probs_ce_backward_inplace", mutates_args=("logits",))
def _probs_backward_inplace(logits: Tensor, q: Tensor, weight: Opt, lse: Tensor, lse_lo: Tensor, a: Tensor,
                           grad_row: Tensor, grad_lse: Opt, ignore_index: int, scalars: list[float]) -> None:
    probs_chunk_grad_(logits, q, _f32(weight), lse, lse_lo, a, grad_row, grad_lse,
                     LossOptions.from_op_args(ignore_index, scalars))


@_probs_backward_inplace.register_fake
def _(logits, q, weight, lse, lse_lo, a, grad_row, grad_lse, ignore_index, scalars):
    return None


@torch.library.custom_op("fusedce_torch::probs_ce_backward", mutates_args=())
def _probs_backward(logits: Tensor, q: Tensor, weight: Opt, lse: Tensor, lse_lo: Tensor, a: Tensor, grad_row: Tensor,
                   grad_lse: Opt, ignore_index: int, scalars: list[float]) -> Tensor:
    return probs_chunk_grad_(logits, q, _f32(weight), lse, lse_lo, a, grad_row, grad_lse,
                            LossOptions.from_op_args(ignore_index, scalars), torch.empty_like(logits))


@_probs_backward.register_fake
def _(logits, q, weight, lse, lse_lo, a, grad_row, grad_lse, ignore_index, scalars):
    return torch.empty_like(logits)


register_rows_autograd("fusedce_torch", "probs_ce")   # the formula: backends/op_autograd.py


def probs_cross_entropy_rows(logits: Tensor, q: Tensor, weight: Opt, opts: LossOptions,
                            inplace_backward: bool = False, stats: bool = True):
    """``cross_entropy_rows`` against probability targets ``q`` ((BT, V), any float dtype, a constant): no row
    ignored, ``predicted`` the argmax of ``logits``."""
    loss, lse, lse_lo, _a, predicted = torch.ops.fusedce_torch.probs_ce_forward(logits, q, weight, *opts.op_args(),
                                                                               stats, inplace_backward)
    return loss, lse, lse_lo, predicted
