"""The autograd formula of a backend's row-loss custom ops, written once for every op family and backend whose ops
follow the same schemas (``<op>`` = ``ce``: class-index targets, namespaces ``fusedce`` (Triton) and
``fusedce_cute``; ``probs_ce``: probability targets, ``fusedce`` and ``fusedce_torch``)."""
from __future__ import annotations

import torch

from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed

N_OPTIONS = 4   # the forward's trailing non-tensor inputs: ignore_index, scalars, stats, inplace_backward


def _setup_context(ctx, inputs, output):
    tensors, (ignore_index, scalars, _stats, inplace_backward) = inputs[:-N_OPTIONS], inputs[-N_OPTIONS:]
    ctx.save_for_backward(*tensors, *output[1:-1])   # + lse, lse_lo, *saved
    ctx.n_inputs, ctx.n_tensors = len(inputs), len(tensors)
    ctx.options = (ignore_index, scalars)   # LossOptions.op_args()
    ctx.inplace, ctx.consumed = inplace_backward, False
    ctx.mark_non_differentiable(*output[2:])


def register_rows_autograd(namespace: str, op: str = "ce") -> None:
    """Register d loss / d logits (and d lse / d logits) on ``<namespace>::<op>_forward``."""
    ops = getattr(torch.ops, namespace)
    backward_op, inplace_op = getattr(ops, f"{op}_backward"), getattr(ops, f"{op}_backward_inplace")

    @backward_formula
    def backward(ctx, grad_row, grad_lse, *_grad_no_grad_outputs):
        """For the upstream per-row gradients of ``loss`` and ``lse`` (any strides, e.g. stride 0; either
        may be None when that output took no part in the graph)."""
        check_backward_allowed(ctx, "fusedce.cross_entropy")
        saved = ctx.saved_tensors
        if grad_row is None:
            lse = saved[ctx.n_tensors]
            grad_row = lse.new_zeros(()).expand(lse.shape)
        args = (*saved, grad_row, grad_lse, *ctx.options)
        if ctx.inplace:
            # A custom op may not return an alias of its input: the mutating op returns nothing and the
            # gradient handed to autograd is ``logits`` itself, now holding d loss / d logits.
            inplace_op(*args)
            ctx.consumed, grad = True, saved[0]
        else:
            grad = backward_op(*args)
        return (grad,) + (None,) * (ctx.n_inputs - 1)

    torch.library.register_autograd(f"{namespace}::{op}_forward", backward, setup_context=_setup_context)
