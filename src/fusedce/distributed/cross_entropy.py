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
from fusedce.distributed import probs_ops
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
    """:func:`fusedce.cross_entropy` on logits split by vocabulary over the ranks of ``group``.

    Equals :func:`fusedce.cross_entropy` on the logits concatenated over the vocabulary, for every option;
    replicated loss, each rank's slice gradient. Semantics: docs/contract.md, "Integrations"; collectives:
    docs/integrations.md, "Collectives".

    Args:
        logits_shard: ``(..., V_r)`` float32 / bfloat16 / float16, this rank's contiguous vocabulary slice.
        target: ``(...)`` int64 / int32 global class ids, identical on every rank; or a float ``(..., V_r)``:
            this rank's slice of class probabilities.
        weight_shard: None or ``(V_r,)``, this rank's slice of the class weights.
        group: the process group; None: the default one.
        vocab_start_index: this slice's first global class; None on every rank: rank order.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``, as :func:`fusedce.cross_entropy`.
        num_items_in_batch: the mean's denominator, if given.
        return_stats: return :class:`fusedce.CrossEntropyOutput` (global lse and argmax).
        backend: ``"auto"`` / ``"torch"`` / ``"triton"``: this rank's kernels.
        token_weights: None or ``(...)`` float per-token loss weights, identical on every rank.

    Returns:
        The fp32 loss (scalar, or ``target.shape`` for ``"none"``) or ``CrossEntropyOutput``.

    Raises:
        The errors of :func:`fusedce.cross_entropy` (the range against the global V), plus ``ValueError`` for
        slices that do not tile ``[0, V)`` or a global V = 0 and ``RuntimeError`` without an initialized
        process group.
    """
    call = checked_vocab_parallel(logits_shard, target, weight_shard, reduction=reduction,
                                  num_items_in_batch=num_items_in_batch, return_stats=return_stats, backend=backend,
                                  token_weights=token_weights, options=options)
    impl = backends.named(call.backend)
    if call.probs:   # probs_ops.py: this rank's slice of probability targets
        return probs_ops.cross_entropy(call, impl, logits_shard, target, group, vocab_start_index)
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
