"""The Triton launches as torch custom ops, so ``torch.compile(fullgraph=True)`` traces through them.

Six ops in the ``fusedce`` namespace (plus the two tiled ones of ``tiled.py``), each "allocate, then
call a launcher" (``launch.py``) plus a fake (meta) implementation that gives the output shapes, dtypes and strides
without touching data:

- ``fusedce::ce_forward(logits, target, weight?, weight_sum?, <options>, stats, inplace_backward)
  -> (loss, lse, lse_lo, predicted)``
  ``loss`` (cross-entropy without z-loss), ``lse``, ``lse_lo`` (lse's rounding error): (BT,) fp32;
  ``predicted``: (BT,) int64, or (0,) when ``stats`` is False. Differentiable outputs: loss and lse.
- ``fusedce::ce_backward(logits, target, weight?, weight_sum?, lse, lse_lo, grad_row, grad_lse?,
  <options>) -> grad``
  ``grad``: (BT, V) contiguous, logits' dtype; a new buffer.
- ``fusedce::ce_backward_inplace(logits!, ...same...) -> ()`` writes the gradient into ``logits``.
  A custom op may not return an alias of an input, so the in-place variant declares the mutation
  (``mutates_args=("logits",)``, schema ``Tensor(a!)``) and returns nothing; the autograd formula
  (``cross_entropy.py``) then hands ``logits`` itself back as the gradient. Under torch.compile, functionalization
  turns the mutation into ``auto_functionalized`` and Inductor re-inplaces it into ``logits``' buffer
  when that is safe (it is when nothing else reads the logits later), else it computes into a copy: the
  in-place write is then a memory hint, never a change of results.
- ``fusedce::ce_backward_out(logits, out!, ...same..., grad_entropy?, entropy?) -> ()`` writes the
  gradient into a caller's buffer ``out`` (the RL ops' ``ChunkCE.grad_(..., out=)``); the two backward
  ops above also take the optional ``grad_entropy`` (upstream of the entropy, any float dtype / stride)
  and ``entropy`` (the forward's) last, defaulting to None (the CE path, unchanged).
- ``fusedce::ce_forward_entropy(logits, target, weight?, weight_sum?, <options>, stats)
  -> (loss, lse, lse_lo, predicted, entropy)``: the forward with the per-row entropy (RL ops; no
  autograd formula: the chunk loop's Functions call the backward ops themselves).
- ``fusedce::ce_chunk_(logits!, target, weight?, weight_sum?, grad_row, z_grad_row, <options>, stats)
  -> (loss, lse, lse_lo, predicted, token_weight)``: the fused forward + gradient of one chunk of
  ``linear_cross_entropy`` (``kernels/ce_chunk.py``), the gradient written over ``logits``;
  ``token_weight`` (BT,) with ``use_token_scaling``, else (0,). No autograd: the chunk loop calls it
  inside its own autograd Function.

``<options>`` are ``ignore_index: int, scalars: float[]``, made by ``LossOptions.op_args`` and read back
by ``LossOptions.from_op_args`` (a custom op cannot take the dataclass; the list keeps these schemas
unchanged when a loss option is added). Python floats reach the kernels as fp32 scalars, in eager and
compiled code alike, so e.g. softcap=30.0 is never promoted to fp64.

Inputs may have any strides (Inductor may pass e.g. an expanded stride-0 upstream gradient): the
kernels take row strides for logits, target, grad_row and grad_lse; ``lse`` and ``weight`` are made contiguous
(BT or V elements, a no-op in practice); logits whose last dim is not stride 1 are copied once (the
in-place op then writes through a contiguous temporary and copies back).
"""
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
    """The gradient written into ``out`` ((BT, V), any float dtype; must not overlap ``logits``: use
    ``ce_backward_inplace`` for that)."""
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
    """``ce_forward`` plus the per-row entropy of softmax(z) (COMPUTE_ENTROPY). No autograd formula:
    its callers (the chunk loop's Functions) differentiate through ``backward_`` / ``backward_out``."""
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
    """``fusedce::ce_forward`` with ``LossOptions``: ``(loss, lse, lse_lo, predicted)``, predicted (0,)
    without stats. loss and lse are differentiable w.r.t. ``logits`` (autograd registered in
    ``cross_entropy.py``)."""
    return torch.ops.fusedce.ce_forward(logits, target, weight, weight_sum, *opts.op_args(), stats,
                                        inplace_backward)


def backward_(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt, lse: torch.Tensor,
              lse_lo: torch.Tensor, grad_row: torch.Tensor, grad_lse: Opt, opts: LossOptions,
              grad_entropy: Opt = None, entropy: Opt = None, out: Opt = None) -> None:
    """Overwrite ``logits`` (``fusedce::ce_backward_inplace``), or fill ``out`` when given
    (``fusedce::ce_backward_out``), with the gradient of ``sum_i grad_row[i] loss_i + grad_lse[i] lse_i
    [+ grad_entropy[i] entropy_i]`` (``entropy`` the forward's, read only with ``grad_entropy``)."""
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
    """``fusedce::ce_forward_entropy`` with ``LossOptions``: ``(loss, lse, lse_lo, predicted, entropy)``,
    predicted (0,) without stats; no gradient."""
    return torch.ops.fusedce.ce_forward_entropy(logits, target, weight, weight_sum, *opts.op_args(), stats)


def loss_and_grad_(logits: torch.Tensor, target: torch.Tensor, weight: Opt, weight_sum: Opt,
                   grad_row: torch.Tensor, z_grad_row: torch.Tensor, opts: LossOptions, stats: bool):
    """``fusedce::ce_chunk_`` with ``LossOptions``: ``(loss, lse, lse_lo, predicted, token_weight)``
    (predicted (0,) without stats, token_weight None without token scaling); ``logits`` is overwritten
    with its gradient."""
    loss, lse, lse_lo, predicted, token_weight = torch.ops.fusedce.ce_chunk_(
        logits, target, weight, weight_sum, grad_row, z_grad_row, *opts.op_args(), stats)
    return loss, lse, lse_lo, predicted, token_weight if opts.use_token_scaling else None
