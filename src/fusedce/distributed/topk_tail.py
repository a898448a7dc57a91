"""The student's tail ``log s_tail`` of the top-k distillation losses on a vocabulary slice: the single-process
slice passes, then two exchanges of (n, 2) fp32 row statistics (docs/internals.md)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.core.options import LossOptions
from fusedce.distill import tail
from fusedce.distributed.layout import VocabLayout


def local_ids(ids: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    """The excluded GLOBAL ids (n, K) (-1: none) as columns of this slice: a class of another slice lands
    outside ``[0, V_r)`` and masks nothing there (``tail._tail_mask``)."""
    return torch.where(ids >= 0, ids - layout.start, -1)


def exchange_tail(stats, layout: VocabLayout) -> tuple:
    """This slice's ``(m, s, mt, st)`` -> the global ones (module docstring); no collective for n == 0."""
    m, s, mt, st = stats
    if m.shape[0] == 0:
        return m, s, mt, st
    top = torch.stack([m, mt], dim=1)
    local_top = top.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=layout.group)           # collective 1: 8 n bytes
    empty = local_top == float("-inf")   # this slice adds exactly 0 there (never 0 * exp(-inf - -inf))
    shift = torch.where(empty, 0.0, local_top - torch.where(torch.isinf(top), 0.0, top))
    sums = torch.where(empty, 0.0, torch.stack([s, st], dim=1) * torch.exp(shift))
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=layout.group)          # collective 2: 8 n bytes
    return top[:, 0], sums[:, 0], top[:, 1], sums[:, 1]


class ShardTailLogits(torch.autograd.Function):
    """``log s_tail`` (n,) fp32 of the logits (n, V_r) of this rank's slice, ``ids`` (n, K) global
    excluded classes (-1: none); differentiable w.r.t. the slice."""

    @staticmethod
    def forward(ctx, logits, ids, layout: VocabLayout, opts: LossOptions):
        ids = local_ids(ids, layout)
        stats = exchange_tail(tail.logits_stats(logits, ids, opts), layout)
        ctx.save_for_backward(logits, ids, *stats)
        ctx.opts = opts
        return tail.log_tail_of(stats)

    @staticmethod
    @backward_formula
    def backward(ctx, g):
        check_backward_allowed(ctx, "fusedce.distributed.vocab_parallel_topk_distillation_loss(tail=True)")
        logits, ids, *stats = ctx.saved_tensors
        return tail.logits_grad(logits, ids, stats, g, ctx.opts), None, None, None


class ShardTailLinear(torch.autograd.Function):
    """``log s_tail`` (n,) fp32 of this rank's slice of the head, differentiable (``grad_hidden`` complete on every
    rank)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, layout: VocabLayout, opts: LossOptions):
        ids = local_ids(ids, layout)
        stats = exchange_tail(tail.head_stats(hidden, weight, bias, ids, opts, True), layout)
        ctx.save_for_backward(hidden, weight, bias, ids, *stats)
        ctx.opts, ctx.layout = opts, layout
        return tail.log_tail_of(stats)

    @staticmethod
    @backward_formula
    def backward(ctx, g):
        check_backward_allowed(ctx, "fusedce.distributed.vocab_parallel_linear_topk_distillation_loss(tail=True)")
        hidden, weight, bias, ids, *stats = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:3])
        g_h, g_w, g_b = tail.head_grads(hidden, weight, bias, ids, stats, g, ctx.opts, True, needs)
        if g_h is not None and hidden.shape[0] > 0:
            dist.all_reduce(g_h, op=dist.ReduceOp.SUM, group=ctx.layout.group)   # partial sums over ranks
        return (None if g_h is None else g_h.to(hidden.dtype), None if g_w is None else g_w.to(weight.dtype),
                None if g_b is None else g_b.to(bias.dtype), None, None, None)
