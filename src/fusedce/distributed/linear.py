"""Vocab-parallel fused linear cross-entropy: the LM head split by vocabulary rows over the ranks."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.distributed as dist

from fusedce.core.autocast import backward_formula
from fusedce.core.entrance import public_op
from fusedce.core import reduction as red
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.lm_head.head import compact_rows, scatter_rows
from fusedce import backends
from fusedce.core.types import CrossEntropyOutput
from fusedce.core.options import LossOptions, LossOptionValues
from fusedce.distributed.exchange import ce_outputs, exchange_ce
from fusedce.distributed.layout import VocabLayout, vocab_layout
from fusedce.ce.checks import check_range, checked_vocab_parallel_linear
from fusedce.distributed import probs_ops
from fusedce.distributed.output import finish
from fusedce.distributed import chunk_ops

if TYPE_CHECKING:
    from typing_extensions import Unpack


class _VocabParallelLinearCE(torch.autograd.Function):
    """hidden (n, H), weight slice (V_r, H), bias slice (V_r,) -> per-row global cross-entropy and lse (n,) fp32,
    argmax, w_t; ``rows`` tokens of logits at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ce_weight, layout: VocabLayout, opts: LossOptions,
                rows: Optional[int], accum_dtype, impl):
        n = hidden.shape[0]

        def fill(p, w, cols):   # the chunk loop, one op (chunk_ops.py)
            p.set_(*chunk_ops.forward("ce", hidden, weight, bias, [target], [w], layout, opts, impl, rows, False))

        w, out = exchange_ce(n, ce_weight, target, layout, opts, fill)
        ctx.save_for_backward(hidden, weight, bias, target, w, out.weight_sum, out.target_weight, out.lse,
                              out.lse_lo)
        ctx.layout, ctx.opts, ctx.rows, ctx.accum, ctx.impl = layout, opts, rows, accum_dtype, impl
        return ce_outputs(ctx, out)

    @staticmethod
    @backward_formula
    def backward(ctx, grad_row, grad_lse, _grad_pred, _grad_wt, _grad_target_prob):
        check_backward_allowed(ctx, "fusedce.distributed.vocab_parallel_linear_cross_entropy")
        hidden, weight, bias, target, w, weight_sum, w_t, lse, lse_lo = ctx.saved_tensors
        if grad_row is None:
            grad_row = lse.new_zeros(()).expand(lse.shape)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        grad_h, grad_w, grad_b = chunk_ops.backward(
            "ce", hidden, weight, bias, [target, w_t, lse, lse_lo, grad_row, grad_lse, None, None], [w, weight_sum],
            ctx.layout, ctx.opts, ctx.impl, ctx.rows, (need_h, need_w, need_b), ctx.accum)
        if need_h and n > 0:
            # each rank holds sum over its own classes of g_c W_c: add the partial sums
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=ctx.layout.group)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return (grad_h, grad_w, grad_b) + (None,) * 7


@public_op("linear")
def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor,
    bias_shard: Optional[torch.Tensor] = None, *, group=None, vocab_start_index: Optional[int] = None,
    ce_weight_shard: Optional[torch.Tensor] = None, reduction: str = "mean",
    num_items_in_batch: Union[int, torch.Tensor, None] = None, chunk_size: Optional[int] = None,
    accum_dtype: torch.dtype = torch.float32, return_stats: bool = False, backend: Optional[str] = None,
    deterministic: Optional[bool] = None, token_weights: Optional[torch.Tensor] = None,
    **options: Unpack[LossOptionValues],
) -> Union[torch.Tensor, CrossEntropyOutput]:
    """:func:`fusedce.linear_cross_entropy` with the LM head split by vocabulary over the ranks of ``group``.

    Equals :func:`fusedce.linear_cross_entropy` with ``weight``, ``bias`` and ``ce_weight`` the slices
    concatenated, for every option; replicated loss. Semantics: docs/contract.md, "Integrations"; collectives:
    docs/integrations.md, "Collectives".

    Args:
        hidden: ``(..., H)`` float32 / bfloat16 / float16, identical on every rank.
        weight_shard: ``(V_r, H)``, this rank's contiguous rows of the LM head, ``hidden``'s dtype.
        target: ``(...)`` int64 / int32 global class ids, identical on every rank; or a float ``(..., V_r)``:
            this rank's slice of class probabilities.
        bias_shard, ce_weight_shard: None or ``(V_r,)`` slices of the bias and of the class weights.
        group, vocab_start_index: as :func:`vocab_parallel_cross_entropy`.
        reduction, num_items_in_batch: as :func:`fusedce.cross_entropy`.
        chunk_size: tokens per chunk of ``chunk_size x V_r`` logits; None: automatic.
        accum_dtype: floating dtype of the ``weight_shard`` / ``bias_shard`` gradient accumulators.
        return_stats: return :class:`fusedce.CrossEntropyOutput`.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"``: this rank's kernels (the matmuls are torch's).
        deterministic: None or a bool, accepted; this op is deterministic whatever its value.
        token_weights: None or ``(...)`` float per-token loss weights, identical on every rank.

    Returns:
        The fp32 loss or ``CrossEntropyOutput``; ``hidden``'s gradient complete on every rank, the slices'
        gradients this rank's, in their dtypes.

    Raises:
        The errors of :func:`vocab_parallel_cross_entropy`, plus ``ValueError`` for H = 0, mismatched H, a
        ``weight_shard`` that is not 2-D, a slice that is not ``(V_r,)`` or ``chunk_size`` < 1, and ``TypeError``
        for mixed dtypes, a non-integer ``chunk_size`` or a non-floating ``accum_dtype``.
    """
    call = checked_vocab_parallel_linear(
        hidden, weight_shard, target, bias_shard, ce_weight_shard=ce_weight_shard, reduction=reduction,
        num_items_in_batch=num_items_in_batch, chunk_size=chunk_size, accum_dtype=accum_dtype,
        return_stats=return_stats, backend=backend, deterministic=deterministic, token_weights=token_weights,
        options=options)
    impl = backends.named(call.backend)
    if call.probs:   # probs_ops.py: this rank's slice of probability targets
        return probs_ops.linear_cross_entropy(call, impl, hidden, weight_shard, target, bias_shard, group,
                                             vocab_start_index)
    opts = call.opts
    layout = vocab_layout(weight_shard.shape[0], vocab_start_index, group, hidden.device)
    check_range(call, layout.n_classes)

    shape, size = call.lead, hidden.shape[-1]
    n = math.prod(shape)
    flat_hidden, flat_target, index = compact_rows(hidden.reshape(n, size), call.target, opts.ignore_index)
    loss_rows, lse, predicted, w_t, target_prob = _VocabParallelLinearCE.apply(
        flat_hidden, weight_shard, bias_shard, flat_target, ce_weight_shard, layout, opts, call.head.rows,
        accum_dtype, impl)
    # back to every row: ignored rows have loss 0, lse 0, argmax -1, w_t 0
    loss_rows, lse, target_prob = (scatter_rows(t, index, n, 0.0) for t in (loss_rows, lse, target_prob))
    predicted = scatter_rows(predicted, index, n, -1)
    if ce_weight_shard is not None:
        w_t = scatter_rows(w_t, index, n, 0.0)
    return finish(loss_rows, lse, predicted, None if ce_weight_shard is None else w_t,
                  call.target, opts, reduction, num_items_in_batch, return_stats, shape,
                  red.times(target_prob if opts.use_token_scaling else None, call.token_weights))
