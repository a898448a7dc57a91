"""The vocab-parallel cross-entropy ops with probability ("soft") targets: each rank holds its slice of the target,
``(..., V_r)``, matching its logits columns / LM-head rows."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fusedce.ce.linear_soft import check_linear_soft_target, index_stand_in
from fusedce.ce.soft_targets import backend_rows, check_soft_target
from fusedce.core import reduction as red, validation as val
from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.core.options import LossOptions, check_flag
from fusedce import backends
from fusedce.distributed import chunk_ops
from fusedce.distributed.layout import VocabLayout, vocab_layout
from fusedce.distributed.soft_rows import SoftPartials, SoftSlice, exchange_soft


def _outputs(ctx, out, stats: bool):
    def empty():   # one tensor per output: the same tensor returned twice breaks Dynamo's autograd.Function
        return out.lse.new_empty(0, dtype=torch.int64)

    predicted = empty() if out.predicted is None else out.predicted
    expected = empty() if out.expected is None else out.expected
    ctx.mark_non_differentiable(predicted, expected)
    return out.loss, out.lse, predicted, expected


class _SoftCE(torch.autograd.Function):
    """(n, V_r) logits slice, (n, V_r) target slice -> per-row global loss (n,) fp32 and lse (both
    differentiable), the global argmax of the logits and of the target (stats only)."""

    @staticmethod
    def forward(ctx, logits, q, w, layout: VocabLayout, opts: LossOptions, impl, stats: bool):
        n = logits.shape[0]
        part, p = SoftSlice(impl, layout, opts), SoftPartials.allocate(n, stats, logits.device)
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


class _LinearSoftCE(torch.autograd.Function):
    """hidden (n, H), weight slice (V_r, H), bias slice, target slice (n, V_r) -> as ``_SoftCE``; logits
    ``rows`` tokens at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, q, w, layout: VocabLayout, opts: LossOptions, rows, accum_dtype,
                impl, stats: bool):
        lse, lo, sums, keys = chunk_ops.forward("soft", hidden, weight, bias, [q], [w], layout, opts, impl, rows,
                                                stats)   # the chunk loop, one op (chunk_ops.py)
        out = exchange_soft(SoftPartials(lse, lo, sums, keys if stats else None), layout)
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
            "soft", hidden, weight, bias, [q, lse, lse_lo, mass, grad_row, grad_lse], [w], ctx.layout, ctx.opts,
            ctx.impl, ctx.rows, needs, ctx.accum)
        if needs[0] and hidden.shape[0] > 0:
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=ctx.layout.group)   # partial sums over ranks
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return (grad_h, grad_w, grad_b) + (None,) * 8


def _finish(loss_rows, lse, predicted, expected, opts, reduction, num_items_in_batch, return_stats, shape,
            token_weights):
    n = loss_rows.shape[0]
    factor = None if token_weights is None else token_weights.detach().reshape(-1).float()
    scales = red.row_count_scales(n, loss_rows.device, num_items_in_batch) if reduction == "mean" else None
    loss = red.reduce(*red.token_scaled(loss_rows, red.z_rows(lse, opts), factor), reduction, scales, shape)
    if not return_stats:
        return loss
    return red.stats(loss, lse, predicted, expected, opts, reduction, scales, shape, factor,
                     valid=torch.ones_like(expected, dtype=torch.bool))


def _flat_slice(target: torch.Tensor, n: int, n_local: int) -> torch.Tensor:
    q = target.reshape(n, n_local)
    return q.contiguous() if q.stride(-1) != 1 and n_local > 1 else q


def cross_entropy(logits_shard, target, weight_shard, group, vocab_start_index, opts: LossOptions, reduction,
                  num_items_in_batch, return_stats, backend, token_weights):
    """``vocab_parallel_cross_entropy`` with ``target`` the (..., V_r) probabilities of this rank's slice
    (after its common checks: ``logits_shard``, ``opts``)."""
    shape, n_local, device = logits_shard.shape[:-1], logits_shard.shape[-1], logits_shard.device
    check_soft_target(target, logits_shard, opts, values=False)
    val.check_vector("weight_shard", weight_shard, n_local, device, constant=True)
    val.check_num_items(num_items_in_batch, device)
    check_flag("return_stats", return_stats)
    val.check_token_weights(token_weights, target, shape)
    impl = backends.get(backend, device)
    backend_rows(impl, backend)   # NotImplementedError on a backend without probability targets
    layout = vocab_layout(n_local, vocab_start_index, group, device, probabilities=target)
    n = math.prod(shape)
    rows = logits_shard.reshape(n, n_local)
    if rows.stride(-1) != 1 and n_local > 1:
        rows = rows.contiguous()
    w = None if weight_shard is None else weight_shard.detach().float().contiguous()
    loss_rows, lse, predicted, expected = _SoftCE.apply(rows, _flat_slice(target, n, n_local), w, layout, opts,
                                                        impl, return_stats)
    return _finish(loss_rows, lse, predicted, expected, opts, reduction, num_items_in_batch, return_stats, shape,
                   token_weights)


def linear_cross_entropy(hidden, weight_shard, target, bias_shard, ce_weight_shard, group, vocab_start_index,
                         opts: LossOptions, reduction, num_items_in_batch, chunk_size, accum_dtype, return_stats,
                         backend, token_weights):
    """``vocab_parallel_linear_cross_entropy`` with ``target`` the (..., V_r) probabilities of this rank's
    slice."""
    val.check_linear(hidden, weight_shard, index_stand_in(hidden, target), bias_shard, ce_weight_shard, chunk_size,
                     accum_dtype, names=("weight_shard", "bias_shard", "ce_weight_shard"), sharded=True)
    check_linear_soft_target(target, hidden, weight_shard, opts, values=False)
    val.check_num_items(num_items_in_batch, hidden.device)
    check_flag("return_stats", return_stats)
    val.check_token_weights(token_weights, target, hidden.shape[:-1])
    impl = backends.get(backend, hidden.device)
    backend_rows(impl, backend)
    n_local = weight_shard.shape[0]
    layout = vocab_layout(n_local, vocab_start_index, group, hidden.device, probabilities=target)
    shape, size = hidden.shape[:-1], hidden.shape[-1]
    n = math.prod(shape)
    rows = None if chunk_size is None else int(chunk_size)   # None: the rule, decided in the loop op
    w = None if ce_weight_shard is None else ce_weight_shard.detach().float().contiguous()
    loss_rows, lse, predicted, expected = _LinearSoftCE.apply(
        hidden.reshape(n, size), weight_shard, bias_shard, _flat_slice(target, n, n_local), w, layout, opts,
        rows, accum_dtype, impl, return_stats)
    return _finish(loss_rows, lse, predicted, expected, opts, reduction, num_items_in_batch, return_stats, shape,
                   token_weights)
