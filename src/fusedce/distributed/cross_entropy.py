"""Vocab-parallel cross-entropy on logits whose class dimension is split over the ranks of a group."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Union

import torch

from fusedce.core.autocast import backward_formula
from fusedce.core.entrance import public_op
from fusedce.core import reduction as red
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce import backends
from fusedce.core.types import CrossEntropyOutput
from fusedce.core.options import LossOptions, LossOptionValues
from fusedce.distributed.exchange import ce_outputs, exchange_ce
from fusedce.distributed.layout import VocabLayout, vocab_layout
from fusedce.ce.checks import check_range, checked_vocab_parallel
from fusedce.distributed import soft_ops
from fusedce.distributed.output import finish
from fusedce.distributed.shard_rows import shard_forward, shard_grad

if TYPE_CHECKING:
    from typing_extensions import Unpack


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """(BT, V_r) logits slice -> per-row global cross-entropy (BT,) fp32 and lse (both differentiable),
    argmax, w_t."""

    @staticmethod
    def forward(ctx, logits, target, weight, layout: VocabLayout, opts: LossOptions, impl):
        def fill(p, w, cols):
            p.key, p.zmax, p.sums[:] = shard_forward(impl, logits, target, w, layout, opts, cols)

        w, out = exchange_ce(logits.shape[0], weight, target, layout, opts, fill)
        ctx.save_for_backward(logits, target, w, out.weight_sum, out.target_weight, out.lse, out.lse_lo)
        ctx.layout, ctx.opts, ctx.impl = layout, opts, impl
        return ce_outputs(ctx, out)

    @staticmethod
    @backward_formula
    def backward(ctx, grad_row, grad_lse, _grad_pred, _grad_wt, _grad_target_prob):
        check_backward_allowed(ctx, "fusedce.distributed.vocab_parallel_cross_entropy")
        logits, target, w, weight_sum, w_t, lse, lse_lo = ctx.saved_tensors
        if grad_row is None:
            grad_row = lse.new_zeros(()).expand(lse.shape)
        grad = shard_grad(ctx.impl, logits, target, w, weight_sum, w_t, lse, lse_lo, grad_row, grad_lse,
                          ctx.layout, ctx.opts)
        return grad, None, None, None, None, None


@public_op("logits")
def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, target: torch.Tensor, weight_shard: Optional[torch.Tensor] = None, *,
    group=None, vocab_start_index: Optional[int] = None, reduction: str = "mean",
    num_items_in_batch: Union[int, torch.Tensor, None] = None, return_stats: bool = False,
    backend: Optional[str] = None, token_weights: Optional[torch.Tensor] = None,
    **options: Unpack[LossOptionValues],
) -> Union[torch.Tensor, CrossEntropyOutput]:
    """``fusedce.cross_entropy`` on logits split by vocabulary over the ranks of ``group``.

    The result equals ``fusedce.cross_entropy`` on the logits concatenated over the vocabulary, for
    every option (label smoothing divides by the GLOBAL ``V``; z-loss uses the global lse; class
    weights are split like the vocabulary). Every rank gets the same (replicated) loss; backward gives
    each rank the gradient of its own slice.

    Args:
        logits_shard: ``(..., V_r)`` float32 / bfloat16 / float16, this rank's contiguous vocabulary slice
            (class dim last); ``V_r`` may differ between ranks (uneven split, even 0).
        target: ``(...)`` int64 / int32 GLOBAL class ids, identical on every rank; or a floating-point
            (float32 / bfloat16 / float16 / float64) ``(..., V_r)`` = ``logits_shard.shape``: this rank's
            slice of class probabilities, with ``fusedce.cross_entropy``'s probability-target semantics
            on the concatenated vocabulary (no row ignored; ``"mean"`` over the rows or
            ``num_items_in_batch``; ``predicted_tokens`` / ``token_accuracy`` against the global argmax of
            the target; ``use_token_scaling`` refused). Only row statistics are exchanged
            (``distributed/soft_rows.py``: all_reduce(MAX) of BT fp32, all_reduce(SUM) of BT x 4 fp32,
            + all_reduce(MAX) of BT x 2 int64 with stats); a negative, NaN or +inf probability on any rank is
            a ``ValueError`` naming ``target`` on every rank, found in the setup all_gather (its 4th
            int64; skipped under torch.compile / CUDA-graph capture).
        weight_shard: optional ``(V_r,)`` class weights of this rank's slice.
        group: the process group (None = default). gloo for CPU tensors, NCCL for CUDA tensors.
        vocab_start_index: first global class id of this slice; None on every rank = rank order
            (rank r's slice follows rank r-1's). Given, it must be given on every rank.
        reduction, num_items_in_batch, return_stats, ``**options`` (the loss options, listed below): as in
            ``fusedce.cross_entropy`` (mean denominator ``sum(w[t])`` uses the
            weight held by the rank owning ``t``). ``return_stats``: ``lse`` global (0 on ignored rows),
            ``predicted_tokens`` the global argmax (lowest global index on ties), -1 on ignored rows.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"`` as in ``fusedce.cross_entropy``: the kernels that
            compute this rank's statistics and gradient.
        token_weights: optional ``(...)`` = ``target.shape`` float per-token loss weights, identical on
            every rank, as in ``fusedce.cross_entropy`` (applied to the replicated per-row loss: no
            communication; NaN / inf on a non-ignored row checked in the target-range check's sync).

    Returns:
        The fp32 loss (scalar, or ``target.shape`` for ``"none"``) or ``CrossEntropyOutput``; the
        gradient w.r.t. ``logits_shard`` has its dtype and shape (ignored rows exactly 0).

    Collectives and host syncs: ``docs/integrations.md`` (Vocab-parallel, Collectives).

    Raises:
        The errors of ``fusedce.cross_entropy`` (``weight_shard`` must be ``(V_r,)``; the target range
        check is against the global ``V``: ``IndexError`` naming the position, value and V; an int32
        ``target`` with an ``ignore_index`` outside int32 is converted to int64 once), plus
        ``ValueError`` for slices that do not tile ``[0, V)`` or a global V = 0 (every rank's slice
        empty, raised on every rank after the setup ``all_gather``; one rank's ``V_r = 0`` is fine) and
        ``RuntimeError`` when ``torch.distributed`` is not initialized. A shape/dtype error found on one
        rank only is raised on that rank before any collective; the others then wait in the setup
        ``all_gather``.
    """
    call = checked_vocab_parallel(logits_shard, target, weight_shard, reduction=reduction,
                                  num_items_in_batch=num_items_in_batch, return_stats=return_stats, backend=backend,
                                  token_weights=token_weights, options=options)
    impl = backends.named(call.backend)
    if call.probs:   # soft_ops.py: this rank's slice of probability targets
        return soft_ops.cross_entropy(call, impl, logits_shard, target, group, vocab_start_index)
    opts, shape, n_local = call.opts, call.lead, logits_shard.shape[-1]
    layout = vocab_layout(n_local, vocab_start_index, group, logits_shard.device)
    check_range(call, layout.n_classes)

    rows = logits_shard.reshape(math.prod(shape), n_local)
    if rows.stride(-1) != 1 and n_local > 1:
        rows = rows.contiguous()  # one copy, only when the class dim is strided
    flat_target = call.target
    loss_rows, lse, predicted, w_t, target_prob = _VocabParallelCrossEntropy.apply(
        rows, flat_target, weight_shard, layout, opts, impl)
    return finish(loss_rows, lse, predicted, None if weight_shard is None else w_t, flat_target, opts,
                  reduction, num_items_in_batch, return_stats, shape,
                  red.times(target_prob if opts.use_token_scaling else None, call.token_weights))
