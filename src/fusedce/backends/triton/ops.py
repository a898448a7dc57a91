"""Autograd for the Triton cross-entropy custom ops, and the backend interface ``cross_entropy_rows``.

Layering (quack style): kernels/*.py -> launch.py (launch into given buffers) -> custom_ops.py (torch
custom ops: allocate + launch, fake impls) -> this file (autograd formula registered on the forward op;
per-row loss only, the reduction is applied by ``functional``). Because every launch is a custom op with
a fake impl and a registered autograd formula, ``torch.compile(fullgraph=True)`` traces
``fusedce.cross_entropy`` forward and backward without a graph break.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...autograd_checks import check_backward_allowed
from ...types import LossOptions
from . import custom_ops

# Inputs of fusedce::ce_forward, in schema order (the autograd formula returns one gradient for each).
_FORWARD_INPUTS = ("logits", "target", "weight", "weight_sum", "ignore_index", "scalars", "stats",
                   "inplace_backward")


def _setup_context(ctx, inputs, output):
    logits, target, weight, weight_sum = inputs[:4]
    _loss, lse, lse_lo, predicted = output
    ctx.save_for_backward(logits, target, weight, weight_sum, lse, lse_lo)
    named = dict(zip(_FORWARD_INPUTS, inputs))
    ctx.options = (named["ignore_index"], named["scalars"])   # LossOptions.op_args()
    ctx.inplace = named["inplace_backward"]
    ctx.consumed = False
    ctx.mark_non_differentiable(lse_lo, predicted)


def _backward(ctx, grad_row, grad_lse, _grad_lse_lo, _grad_predicted):
    """d loss / d logits for the upstream per-row gradients of ``loss`` and ``lse`` (any strides, e.g.
    stride 0; either may be None when that output took no part in the graph)."""
    check_backward_allowed(ctx, "fusedce.cross_entropy")
    logits, target, weight, weight_sum, lse, lse_lo = ctx.saved_tensors
    if grad_row is None:
        grad_row = lse.new_zeros(()).expand(lse.shape)
    if ctx.inplace:
        # A custom op may not return an alias of its input: the mutating op returns nothing and the
        # gradient handed to autograd is ``logits`` itself, now holding d loss / d logits.
        torch.ops.fusedce.ce_backward_inplace(logits, target, weight, weight_sum, lse, lse_lo, grad_row,
                                              grad_lse, *ctx.options)
        ctx.consumed = True
        grad = logits
    else:
        grad = torch.ops.fusedce.ce_backward(logits, target, weight, weight_sum, lse, lse_lo, grad_row,
                                             grad_lse, *ctx.options)
    return (grad,) + (None,) * (len(_FORWARD_INPUTS) - 1)


torch.library.register_autograd("fusedce::ce_forward", _backward, setup_context=_setup_context)


def _weights(weight: Optional[torch.Tensor]):
    if weight is None:
        return None, None
    return weight.contiguous(), weight.float().sum().reshape(1)


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                       opts: LossOptions, inplace_backward: bool = False, stats: bool = True):
    """Per-row loss of ``logits`` ((BT, V), last-dim stride 1) against ``target`` ((BT,)).

    Returns ``(loss (BT,) fp32, lse (BT,) fp32, lse_lo (BT,) fp32, predicted (BT,) int64 or empty if not
    stats)``: the cross-entropy without z-loss and the lse (0 on ignored rows), both differentiable
    w.r.t. ``logits``, and lse's rounding error (no gradient).
    With ``inplace_backward`` the backward pass writes the gradient into ``logits``' storage (a second
    backward then raises ``RuntimeError``).
    """
    w, weight_sum = _weights(weight)
    return custom_ops.forward(logits, target, w, weight_sum, opts, stats, inplace_backward)
