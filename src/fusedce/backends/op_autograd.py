"""The autograd formula of a kernel backend's cross-entropy custom ops, written once for every backend
whose ops follow the same schemas (``triton``: namespace ``fusedce``; ``cute``: ``fusedce_cute``):

- ``<ns>::ce_forward(logits, target, weight?, weight_sum?, ignore_index, scalars, stats, inplace_backward)
  -> (loss, lse, lse_lo, predicted)``;
- ``<ns>::ce_backward(logits, target, weight?, weight_sum?, lse, lse_lo, grad_row, grad_lse?, ignore_index,
  scalars) -> grad`` and ``<ns>::ce_backward_inplace(...)`` (same inputs, writes into ``logits``).

Registered on the forward op (``torch.library.register_autograd``), so ``torch.compile(fullgraph=True)``
traces forward and backward without a graph break.
"""
from __future__ import annotations

import torch

from ..autograd_checks import check_backward_allowed

# Inputs of <ns>::ce_forward, in schema order (the formula returns one gradient for each).
FORWARD_INPUTS = ("logits", "target", "weight", "weight_sum", "ignore_index", "scalars", "stats",
                  "inplace_backward")


def _setup_context(ctx, inputs, output):
    logits, target, weight, weight_sum = inputs[:4]
    _loss, lse, lse_lo, predicted = output
    ctx.save_for_backward(logits, target, weight, weight_sum, lse, lse_lo)
    named = dict(zip(FORWARD_INPUTS, inputs))
    ctx.options = (named["ignore_index"], named["scalars"])   # LossOptions.op_args()
    ctx.inplace, ctx.consumed = named["inplace_backward"], False
    ctx.mark_non_differentiable(lse_lo, predicted)


def register_ce_autograd(namespace: str) -> None:
    """Register d loss / d logits on ``<namespace>::ce_forward``."""
    ops = getattr(torch.ops, namespace)

    def backward(ctx, grad_row, grad_lse, _grad_lse_lo, _grad_predicted):
        """For the upstream per-row gradients of ``loss`` and ``lse`` (any strides, e.g. stride 0; either
        may be None when that output took no part in the graph)."""
        check_backward_allowed(ctx, "fusedce.cross_entropy")
        logits, target, weight, weight_sum, lse, lse_lo = ctx.saved_tensors
        if grad_row is None:
            grad_row = lse.new_zeros(()).expand(lse.shape)
        if ctx.inplace:
            # A custom op may not return an alias of its input: the mutating op returns nothing and the
            # gradient handed to autograd is ``logits`` itself, now holding d loss / d logits.
            ops.ce_backward_inplace(logits, target, weight, weight_sum, lse, lse_lo, grad_row, grad_lse,
                                    *ctx.options)
            ctx.consumed = True
            grad = logits
        else:
            grad = ops.ce_backward(logits, target, weight, weight_sum, lse, lse_lo, grad_row, grad_lse,
                                   *ctx.options)
        return (grad,) + (None,) * (len(FORWARD_INPUTS) - 1)

    torch.library.register_autograd(f"{namespace}::ce_forward", backward, setup_context=_setup_context)
