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
from fusedce.distributed import soft_ops
from fusedce.distributed.output import finish
from fusedce.distributed import chunk_ops

if TYPE_CHECKING:
    from typing_extensions import Unpack


class _VocabParallelLinearCE(torch.autograd.Function):
    """hidden (n, H), weight slice (V_r, H), bias slice (V_r,) -> per-row global cross-entropy (n,)
    fp32 and lse (both with gradient), argmax, w_t (BT x V_r logits never exist: ``rows`` tokens at a
    time)."""

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
    """``fusedce.linear_cross_entropy`` with the LM head split by vocabulary over the ranks of ``group``.

    Equals ``fusedce.linear_cross_entropy(hidden, weight, target, bias, ce_weight=...)`` with ``weight``,
    ``bias`` and ``ce_weight`` the concatenation of the slices, for every option (label smoothing over
    the GLOBAL ``V``, z-loss on the global lse). The loss is replicated on every rank.

    Args:
        hidden: ``(..., H)`` float32 / bfloat16 / float16, identical on every rank.
        weight_shard: ``(V_r, H)``, this rank's contiguous rows of the LM head, ``hidden``'s dtype;
            ``V_r`` may differ between ranks.
        target: ``(...)`` int64 / int32 GLOBAL class ids, identical on every rank; or a floating-point
            ``(..., V_r)`` = ``hidden.shape[:-1] + (V_r,)``: this rank's slice of class probabilities
            (matching ``weight_shard``), as in ``vocab_parallel_cross_entropy`` (same semantics,
            collectives and value check; every row computed, the logits ``chunk_size x V_r`` at a time
            in fp32; the same backward, with its ``grad_hidden`` all_reduce).
        bias_shard, ce_weight_shard: optional ``(V_r,)`` slices of the bias and of the class weights.
        group, vocab_start_index: as in ``vocab_parallel_cross_entropy``.
        reduction, num_items_in_batch, ``**options`` (the loss options, listed below):
            as in ``fusedce.cross_entropy``, on logits computed in ``hidden``'s dtype (fp32 accumulation).
        chunk_size: tokens per chunk (logits are ``chunk_size x V_r``). None = the single-process rule
            (``lm_head/head.py``) with ``V_r`` for ``V``: ``max(1024, BT * H / V_r)`` rows.
        accum_dtype: dtype of the ``weight_shard`` / ``bias_shard`` gradient accumulators.
        return_stats: ``CrossEntropyOutput``; as in the single-process op, ``lse`` is 0 on ignored rows.
        backend: as in ``fusedce.linear_cross_entropy``: the kernels of this rank's statistics and
            gradients (Triton on CUDA by default; the matmuls are torch's).
        deterministic: accepted as in ``fusedce.linear_cross_entropy`` (None, or a bool); this op is
            deterministic whatever its value: per chunk torch matmuls and the backend's slice kernels
            (no float atomics), and collectives whose reduction order is fixed for a given group, sizes
            and backend settings (gloo; NCCL with the same algorithm / protocol choice).
        token_weights: optional ``(...)`` = ``target.shape`` float per-token loss weights, identical on
            every rank, as in ``fusedce.linear_cross_entropy`` (they scale the replicated per-row loss,
            so each rank's gradients; no communication).

    Returns:
        The fp32 loss or ``CrossEntropyOutput``. Gradients of ``hidden`` (complete, the same on every
        rank), ``weight_shard`` and ``bias_shard`` (this rank's slice) have their tensors' dtypes.

    Ignored tokens cost no matmul FLOPs and no communication: non-ignored rows are gathered first (one
    host sync; skipped under torch.compile / CUDA-graph capture, where every row is computed).

    Collectives and host syncs: ``docs/integrations.md`` (Vocab-parallel, Collectives).

    Raises:
        The errors of ``vocab_parallel_cross_entropy`` (a global V = 0 included; ``weight_shard`` of
        shape ``(0, H)`` on some ranks is fine), plus ``ValueError`` when H = 0 (``hidden`` ``(..., 0)``
        or ``weight_shard`` ``(V_r, 0)``), ``hidden.shape[-1] != weight_shard.shape[1]``,
        ``weight_shard`` is not 2-D, a slice is not ``(V_r,)`` or ``chunk_size`` < 1, and ``TypeError``
        when ``hidden``, ``weight_shard`` and ``bias_shard`` dtypes differ, ``chunk_size`` is not an
        integer or ``accum_dtype`` is not a floating-point ``torch.dtype``.
    """
    call = checked_vocab_parallel_linear(
        hidden, weight_shard, target, bias_shard, ce_weight_shard=ce_weight_shard, reduction=reduction,
        num_items_in_batch=num_items_in_batch, chunk_size=chunk_size, accum_dtype=accum_dtype,
        return_stats=return_stats, backend=backend, deterministic=deterministic, token_weights=token_weights,
        options=options)
    impl = backends.named(call.backend)
    if call.probs:   # soft_ops.py: this rank's slice of probability targets
        return soft_ops.linear_cross_entropy(call, impl, hidden, weight_shard, target, bias_shard, group,
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
