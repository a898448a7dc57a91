"""Autograd for the CuTe cross-entropy custom ops, and the backend interface ``cross_entropy_rows``.

Layering: kernels/*.py -> launch.py (into given buffers) -> custom_ops.py (torch custom ops: allocate +
launch, fake impls) -> this file (the autograd formula registered on ``fusedce_cute::ce_forward``;
per-row loss only, the reduction is applied by ``functional``). Every launch being a custom op with a
fake impl, ``torch.compile(fullgraph=True)`` traces ``fusedce.cross_entropy(..., backend="cute")``
forward and backward without a graph break.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...autograd_checks import check_backward_allowed
from ...types import LossOptions
from . import custom_ops  # noqa: F401 - registers the fusedce_cute ops

# Inputs of fusedce_cute::ce_forward, in schema order (the autograd formula returns one gradient each).
_FORWARD_INPUTS = ("logits", "target", "weight", "weight_sum", "ignore_index", "scalars", "stats",
                   "inplace_backward")


def _setup_context(ctx, inputs, output):
    logits, target, weight, weight_sum = inputs[:4]
    _loss, lse, lse_lo, predicted = output
    ctx.save_for_backward(logits, target, weight, weight_sum, lse, lse_lo)
    named = dict(zip(_FORWARD_INPUTS, inputs))
    ctx.options = (named["ignore_index"], named["scalars"])   # LossOptions.op_args()
    ctx.inplace, ctx.consumed = named["inplace_backward"], False
    ctx.mark_non_differentiable(lse_lo, predicted)


def _backward(ctx, grad_row, grad_lse, _grad_lse_lo, _grad_predicted):
    """d loss / d logits for the upstream per-row gradients of ``loss`` and ``lse`` (any strides; either
    may be None when that output took no part in the graph)."""
    check_backward_allowed(ctx, "fusedce.cross_entropy")
    logits, target, weight, weight_sum, lse, lse_lo = ctx.saved_tensors
    if grad_row is None:
        grad_row = lse.new_zeros(()).expand(lse.shape)
    if ctx.inplace:
        torch.ops.fusedce_cute.ce_backward_inplace(logits, target, weight, weight_sum, lse, lse_lo, grad_row,
                                                   grad_lse, *ctx.options)
        ctx.consumed = True
        grad = logits
    else:
        grad = torch.ops.fusedce_cute.ce_backward(logits, target, weight, weight_sum, lse, lse_lo, grad_row,
                                                  grad_lse, *ctx.options)
    return (grad,) + (None,) * (len(_FORWARD_INPUTS) - 1)


torch.library.register_autograd("fusedce_cute::ce_forward", _backward, setup_context=_setup_context)


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                       opts: LossOptions, inplace_backward: bool = False, stats: bool = True):
    """Per-row loss of ``logits`` ((BT, V), CUDA) against ``target`` ((BT,)): ``(loss, lse, lse_lo,
    predicted)`` as the Triton backend's (``backends/__init__.py``)."""
    weight_sum = None if weight is None else weight.float().sum().reshape(1)
    return torch.ops.fusedce_cute.ce_forward(logits, target, weight, weight_sum, *opts.op_args(), stats,
                                             inplace_backward)
