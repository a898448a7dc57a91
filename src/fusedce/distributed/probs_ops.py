"""The vocab-parallel cross-entropy ops with probability ("soft") targets: each rank holds its slice of the target,
``(..., V_r)``, matching its logits columns / LM-head rows."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fusedce.core import reduction as red
from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.core.options import LossOptions
from fusedce.distributed import chunk_ops
from fusedce.distributed.layout import VocabLayout, vocab_layout
from fusedce.distributed.probs_rows import ProbsPartials, ProbsSlice, exchange_soft


def _outputs(ctx, out, stats: bool):
    def empty():   # one tensor per output: the same tensor returned twice breaks Dynamo's autograd.Function
        return out.lse.new_empty(0, dtype=torch.int64)

    predicted = empty() if out.predicted is None else out.predicted
    expected = empty() if out.expected is None else out.expected
    ctx.mark_non_differentiable(predicted, expected)
    return out.loss, out.lse, predicted, expected


class _ProbsCE(torch.autograd.Function):
    """(n, V_r) logits slice, (n, V_r) target slice -> per-row global loss (n,) fp32 and lse (both
    differentiable), the global argmax of the logits and of the target (stats only)."""

    @staticmethod
    def forward(ctx, logits, q, w, layout: VocabLayout, opts: LossOptions, impl, stats: bool):
        n = logits.shape[0]
        part, p = ProbsSlice(impl, layout, opts), ProbsPartials.allocate(n, stats, logits.device)
        part.fill(p, slice(0, n), logits, q, w)
        out = exchange_soft(p, layout)
        ctx.save_for_backward(logits, q, w, out.lse, out.lse_lo, out.mass)
        ctx.part = part
        return _outputs(ctx, out, stats)

    @staticmethod
    @backward_formula
    def backward(ctx, grad_row, grad_lse, _grad_pred, _grad_expected):
        check_backward_allowed(ctx, "fusedce.distributed.vocab_parallel_cross_entropy")
        logits, q, w, lse, lse_lo, mass = ctx.saved_tensors
        if grad_row is None:
            grad_row = lse.new_zeros(()).expand(lse.shape)
        grad = ctx.part.grad_(logits.clone(), q, w, lse, lse_lo, mass, grad_row, grad_lse)
        return (grad,) + (None,) * 6


class _LinearProbsCE(torch.autograd.Function):
    """hidden (n, H), weight slice (V_r, H), bias slice, target slice (n, V_r) -> as ``_ProbsCE``; logits
    ``rows`` tokens at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, q, w, layout: VocabLayout, opts: LossOptions, rows, accum_dtype,
                impl, stats: bool):
        lse, lo, sums, keys = chunk_ops.forward("probs", hidden, weight, bias, [q], [w], layout, opts, impl, rows,
                                                stats)   # the chunk loop, one op (chunk_ops.py)
        out = exchange_soft(ProbsPartials(lse, lo, sums, keys if stats else None), layout)
        ctx.save_for_backward(hidden, weight, bias, q, w, out.lse, out.lse_lo, out.mass)
        ctx.impl, ctx.opts, ctx.layout, ctx.rows, ctx.accum = impl, opts, layout, rows, accum_dtype
        return _outputs(ctx, out, stats)

    @staticmethod
    @backward_formula
    def backward(ctx, grad_row, grad_lse, _grad_pred, _grad_expected):
        check_backward_allowed(ctx, "fusedce.distributed.vocab_parallel_linear_cross_entropy")
        hidden, weight, bias, q, w, lse, lse_lo, mass = ctx.saved_tensors
        if grad_row is None:
            grad_row = lse.new_zeros(()).expand(lse.shape)
        needs = ctx.needs_input_grad[:3]
        grad_h, grad_w, grad_b = chunk_ops.backward(
            "probs", hidden, weight, bias, [q, lse, lse_lo, mass, grad_row, grad_lse], [w], ctx.layout, ctx.opts,
            ctx.impl, ctx.rows, needs, ctx.accum)
        if needs[0] and hidden.shape[0] > 0:
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=ctx.layout.group)   # partial sums over ranks
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return (grad_h, grad_w, grad_b) + (None,) * 8


def _finish(call, loss_rows, lse, predicted, expected):
    opts, reduction, factor = call.opts, call.reduction, call.token_weights
    scales = red.row_count_scales(loss_rows.shape[0], loss_rows.device, call.num_items) if reduction == "mean" else None
    loss = red.reduce(*red.token_scaled(loss_rows, red.z_rows(lse, opts), factor), reduction, scales, call.lead)
    if not call.return_stats:
        return loss
    return red.stats(loss, lse, predicted, expected, opts, reduction, scales, call.lead, factor,
                     valid=torch.ones_like(expected, dtype=torch.bool))


def cross_entropy(call, impl, logits_shard, target, group, vocab_start_index):
    """``vocab_parallel_cross_entropy`` on a checked ``CECall`` with this rank's slice of probabilities
    (``target``: as given, for the value check of the setup collective)."""
    shape, n_local, device = call.lead, logits_shard.shape[-1], logits_shard.device
    layout = vocab_layout(n_local, vocab_start_index, group, device, probabilities=target)
    n = math.prod(shape)
    rows = logits_shard.reshape(n, n_local)
    if rows.stride(-1) != 1 and n_local > 1:
        rows = rows.contiguous()
    loss_rows, lse, predicted, expected = _ProbsCE.apply(rows, call.target, call.class_weights, layout, call.opts,
                                                        impl, call.return_stats)
    return _finish(call, loss_rows, lse, predicted, expected)


def linear_cross_entropy(call, impl, hidden, weight_shard, target, bias_shard, group, vocab_start_index):
    """``vocab_parallel_linear_cross_entropy`` on a checked ``CECall`` with this rank's slice of
    probabilities."""
    layout = vocab_layout(weight_shard.shape[0], vocab_start_index, group, hidden.device, probabilities=target)
    n = math.prod(call.lead)
    loss_rows, lse, predicted, expected = _LinearProbsCE.apply(
        hidden.reshape(n, hidden.shape[-1]), weight_shard, bias_shard, call.target, call.class_weights, layout,
        call.opts, call.head.rows, call.head.accum_dtype, impl, call.return_stats)
    return _finish(call, loss_rows, lse, predicted, expected)
