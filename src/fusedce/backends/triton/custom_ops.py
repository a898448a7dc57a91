"""The Triton launches as torch custom ops, so ``torch.compile(fullgraph=True)`` traces through them."""
from __future__ import annotations

from typing import Optional

import torch

from ..layout import opt_contiguous, unit_stride
from fusedce.core.options import LossOptions
from .launch import ce_backward as launch_backward
from .launch import ce_chunk_ as launch_chunk
from .launch import ce_forward as launch_forward

Opt = Optional[torch.Tensor]


# ---------------------------------------------------------------- forward

@torch.library.custom_op("fusedce::ce_forward", mutates_args=())
def ce_forward(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt,
               ignore_index: int, scalars: list[float], stats: bool, inplace_backward: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # ``inplace_backward`` does not change the forward; it is an input so that the autograd formula
    # registered on this op (cross_entropy.py) can pick the backward variant.
    loss, lse, lse_lo, predicted = _forward_buffers(logits, stats)
    launch_forward(unit_stride(logits), target, opt_contiguous(weight), opt_contiguous(weight_sum),
                   LossOptions.from_op_args(ignore_index, scalars),
                   loss, lse, lse_lo, predicted if stats else None)
    return loss, lse, lse_lo, predicted


def _forward_buffers(logits: torch.Tensor, stats: bool):
    n_rows = logits.shape[0]
    return (logits.new_empty(n_rows, dtype=torch.float32), logits.new_empty(n_rows, dtype=torch.float32),
            logits.new_empty(n_rows, dtype=torch.float32),
            logits.new_empty(n_rows if stats else 0, dtype=torch.int64))


@ce_forward.register_fake
def _(logits, target, weight, weight_sum, ignore_index, scalars, stats, inplace_backward):
    return _forward_buffers(logits, stats)


# ---------------------------------------------------------------- backward, into a new buffer

@torch.library.custom_op("fusedce::ce_backward", mutates_args=())
def ce_backward(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt,
                lse: torch.Tensor, lse_lo: torch.Tensor, grad_row: torch.Tensor, grad_lse: Opt,
                ignore_index: int, scalars: list[float]) -> torch.Tensor:
    grad = logits.new_empty(logits.shape)
    launch_backward(unit_stride(logits), target, opt_contiguous(weight), opt_contiguous(weight_sum),
                    lse.contiguous(), lse_lo.contiguous(), grad_row, grad_lse,
                    LossOptions.from_op_args(ignore_index, scalars), grad)
    return grad


@ce_backward.register_fake
def _(logits, target, weight, weight_sum, lse, lse_lo, grad_row, grad_lse, ignore_index, scalars):
    return logits.new_empty(logits.shape)


# ---------------------------------------------------------------- backward, into logits' storage

@torch.library.custom_op("fusedce::ce_backward_inplace", mutates_args=("logits",))
def ce_backward_inplace(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt,
                        lse: torch.Tensor, lse_lo: torch.Tensor, grad_row: torch.Tensor, grad_lse: Opt,
                        ignore_index: int, scalars: list[float], grad_entropy: Opt = None,
                        entropy: Opt = None) -> None:
    opts = LossOptions.from_op_args(ignore_index, scalars)
    rows = unit_stride(logits)   # each program reads its block before writing it: aliasing is safe
    launch_backward(rows, target, opt_contiguous(weight), opt_contiguous(weight_sum),
                    lse.contiguous(), lse_lo.contiguous(), grad_row, grad_lse, opts, rows,
                    grad_entropy=grad_entropy, entropy=opt_contiguous(entropy))
    if rows is not logits:
        logits.copy_(rows)


@ce_backward_inplace.register_fake
def _(logits, target, weight, weight_sum, lse, lse_lo, grad_row, grad_lse, ignore_index, scalars,
      grad_entropy=None, entropy=None):
    return None


# ---------------------------------------------------------------- backward, into a caller's buffer

@torch.library.custom_op("fusedce::ce_backward_out", mutates_args=("out",))
def ce_backward_out(logits: torch.Tensor, out: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt,
                    lse: torch.Tensor, lse_lo: torch.Tensor, grad_row: torch.Tensor, grad_lse: Opt,
                    ignore_index: int, scalars: list[float], grad_entropy: Opt = None,
                    entropy: Opt = None) -> None:
    """The gradient written into ``out`` (must not overlap ``logits``: ``ce_backward_inplace`` for that)."""
    opts = LossOptions.from_op_args(ignore_index, scalars)
    dest = unit_stride(out)
    launch_backward(unit_stride(logits), target, opt_contiguous(weight), opt_contiguous(weight_sum),
                    lse.contiguous(), lse_lo.contiguous(), grad_row, grad_lse, opts, dest,
                    grad_entropy=grad_entropy, entropy=opt_contiguous(entropy))
    if dest is not out:
        out.copy_(dest)


@ce_backward_out.register_fake
def _(logits, out, target, weight, weight_sum, lse, lse_lo, grad_row, grad_lse, ignore_index, scalars,
      grad_entropy=None, entropy=None):
    return None


# ---------------------------------------------------------------- forward with the entropy (RL ops)

@torch.library.custom_op("fusedce::ce_forward_entropy", mutates_args=())
def ce_forward_entropy(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt,
                       ignore_index: int, scalars: list[float], stats: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ce_forward`` plus the per-row entropy (COMPUTE_ENTROPY); no autograd formula (callers use ``backward_``)."""
    loss, lse, lse_lo, predicted = _forward_buffers(logits, stats)
    entropy = torch.empty_like(loss)
    launch_forward(unit_stride(logits), target, opt_contiguous(weight), opt_contiguous(weight_sum),
                   LossOptions.from_op_args(ignore_index, scalars),
                   loss, lse, lse_lo, predicted if stats else None, entropy)
    return loss, lse, lse_lo, predicted, entropy


@ce_forward_entropy.register_fake
def _(logits, target, weight, weight_sum, ignore_index, scalars, stats):
    loss, lse, lse_lo, predicted = _forward_buffers(logits, stats)
    return loss, lse, lse_lo, predicted, torch.empty_like(loss)


# ---------------------------------------------------------------- fused chunk: loss + gradient over the logits

@torch.library.custom_op("fusedce::ce_chunk_", mutates_args=("logits",))
def ce_chunk_(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt,
              grad_row: torch.Tensor, z_grad_row: torch.Tensor, ignore_index: int, scalars: list[float],
              stats: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    opts = LossOptions.from_op_args(ignore_index, scalars)
    loss, lse, lse_lo, predicted, token_weight = _chunk_buffers(logits, stats, opts.use_token_scaling)
    rows = unit_stride(logits)
    launch_chunk(rows, target, opt_contiguous(weight), opt_contiguous(weight_sum), grad_row, z_grad_row, opts,
                 loss, lse, lse_lo, predicted if stats else None,
                 token_weight if opts.use_token_scaling else None)
    if rows is not logits:
        logits.copy_(rows)
    return loss, lse, lse_lo, predicted, token_weight


def _chunk_buffers(logits: torch.Tensor, stats: bool, token_scaling: bool):
    n_rows = logits.shape[0]
    token_weight = logits.new_empty(n_rows if token_scaling else 0, dtype=torch.float32)
    return (*_forward_buffers(logits, stats), token_weight)


@ce_chunk_.register_fake
def _(logits, target, weight, weight_sum, grad_row, z_grad_row, ignore_index, scalars, stats):
    return _chunk_buffers(logits, stats, LossOptions.from_op_args(ignore_index, scalars).use_token_scaling)


# ---------------------------------------------------------------- typed entry points for this backend

def forward(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt, opts: LossOptions,
            stats: bool, inplace_backward: bool = False):
    """``fusedce::ce_forward`` with ``LossOptions``: ``(loss, lse, lse_lo, predicted)``; loss and lse are
    differentiable (``cross_entropy.py``)."""
    return torch.ops.fusedce.ce_forward(logits, target, weight, weight_sum, *opts.op_args(), stats,
                                        inplace_backward)


def backward_(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt, lse: torch.Tensor,
              lse_lo: torch.Tensor, grad_row: torch.Tensor, grad_lse: Opt, opts: LossOptions,
              grad_entropy: Opt = None, entropy: Opt = None, out: Opt = None) -> None:
    """Overwrite ``logits`` (or fill ``out``) with the gradient of ``sum_i grad_row[i] loss_i + grad_lse[i] lse_i
    [+ grad_entropy[i] entropy_i]``."""
    if grad_entropy is None:
        entropy = None
    if out is None or out is logits:
        torch.ops.fusedce.ce_backward_inplace(logits, target, weight, weight_sum, lse, lse_lo, grad_row, grad_lse,
                                              *opts.op_args(), grad_entropy, entropy)
    else:
        torch.ops.fusedce.ce_backward_out(logits, out, target, weight, weight_sum, lse, lse_lo, grad_row, grad_lse,
                                          *opts.op_args(), grad_entropy, entropy)


def forward_entropy(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt, opts: LossOptions,
                    stats: bool):
    """``fusedce::ce_forward_entropy`` with ``LossOptions``: ``(loss, lse, lse_lo, predicted, entropy)``."""
    return torch.ops.fusedce.ce_forward_entropy(logits, target, weight, weight_sum, *opts.op_args(), stats)


def loss_and_grad_(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt,
                   grad_row: torch.Tensor, z_grad_row: torch.Tensor, opts: LossOptions, stats: bool):
    """``fusedce::ce_chunk_`` with ``LossOptions``: ``(loss, lse, lse_lo, predicted, token_weight)``, ``logits``
    overwritten with its gradient."""
    loss, lse, lse_lo, predicted, token_weight = torch.ops.fusedce.ce_chunk_(
        logits, target, weight, weight_sum, grad_row, z_grad_row, *opts.op_args(), stats)
    return loss, lse, lse_lo, predicted, token_weight if opts.use_token_scaling else None
