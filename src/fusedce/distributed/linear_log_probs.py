"""Vocab-parallel per-token log-probabilities and entropy from the hidden states (RL): the LM head split by vocabulary
rows over the ranks, logits one chunk of tokens at a time (``rows x V_r``, never BT x V_r), as ``linear.py`` does
for the cross-entropy (each pass's loop one op, ``chunk_ops.py``)."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from fusedce.core.autocast import backward_formula
from fusedce.core.entrance import public_op
from fusedce import backends
from fusedce.core import validation as val
from fusedce.rl import checks as rc
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.lm_head import invariant
from fusedce.lm_head.head import compact_rows, scatter_rows
from fusedce.core.options import LossOptions
from fusedce.core.types import TokenLogProbs, TokenStats
from fusedce.lm_head.head import check_logits_dtype
from fusedce.rl.kclass import result
from fusedce.rl.kclass_head import entries
from fusedce.distributed.exchange import Partials, sum_over_ranks_
from fusedce.distributed.layout import VocabLayout, vocab_layout
from fusedce.distributed.log_probs import exchange_log_probs, finish, upstreams
from fusedce.distributed.kclass_log_probs import VocabParallelLinearLogProbsK
from fusedce.distributed import chunk_ops, sampled_log_probs
from fusedce.distributed.shard_rows import Columns


class _VocabParallelLinearLogProbs(torch.autograd.Function):
    """hidden (n, H), weight slice (V_r, H), bias slice (V_r,) -> global per-row log-probs (n,) fp32
    and entropy (n,) fp32 (empty unless asked), both differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, layout: VocabLayout, opts: LossOptions, rows: int, impl,
                want_entropy: bool, ordered: bool = False):
        n = hidden.shape[0]
        cols = Columns(False, False, want_entropy)
        p = Partials.allocate(n, cols, False, hidden.device)
        p.set_(*chunk_ops.forward("ce", hidden, weight, bias, [target], [None], layout, opts, impl, rows, want_entropy))
        log_probs, entropy, lse, lse_lo = exchange_log_probs(p, target, layout, opts, cols, ordered)
        ctx.save_for_backward(hidden, weight, bias, target, lse, lse_lo, entropy)
        ctx.layout, ctx.opts, ctx.rows, ctx.impl, ctx.want_entropy = layout, opts, rows, impl, want_entropy
        ctx.ordered = ordered
        return log_probs, entropy

    @staticmethod
    @backward_formula
    def backward(ctx, grad_log_probs, grad_entropy):
        check_backward_allowed(ctx, "fusedce.distributed.vocab_parallel_linear_token_log_probs")
        hidden, weight, bias, target, lse, lse_lo, entropy = ctx.saved_tensors
        grad_row, k = upstreams(grad_log_probs, grad_entropy, lse, ctx.want_entropy)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        grad_h, grad_w, grad_b = chunk_ops.backward(
            "ce", hidden, weight, bias, [target, None, lse, lse_lo, grad_row, None, k, None if k is None else entropy],
            [None, None], ctx.layout, ctx.opts, ctx.impl, ctx.rows, (need_h, need_w, need_b), torch.float32)
        if need_h and n > 0:
            # each rank holds sum over its own classes of g_c W_c: add the partial sums
            sum_over_ranks_(grad_h, ctx.layout.group, ctx.ordered)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return (grad_h, grad_w, grad_b) + (None,) * 7


@public_op("linear")
def vocab_parallel_linear_token_log_probs(
    hidden: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor,
    bias_shard: Optional[torch.Tensor] = None, *, group=None, vocab_start_index: Optional[int] = None,
    temperature: float = 1.0, softcap: Optional[float] = None, ignore_index: int = -100,
    return_entropy: bool = False, backend: Optional[str] = None, logit_scale: float = 1.0,
    chunk_size: Optional[int] = None, deterministic: Optional[bool] = None, batch_invariant: bool = False,
    return_stats: bool = False, logits_dtype: str = "float32", top_k=None, top_p=None,
) -> Union[torch.Tensor, TokenLogProbs, TokenStats]:
    """:func:`fusedce.linear_token_log_probs` with the LM head split by vocabulary over the ranks of ``group``.

    Equals :func:`fusedce.linear_token_log_probs` with ``weight`` and ``bias`` the slices concatenated;
    replicated outputs. Semantics: docs/contract.md, "Integrations"; collectives: docs/integrations.md,
    "Collectives".

    Args:
        hidden: ``(..., H)`` float32 / bfloat16 / float16, identical on every rank.
        weight_shard: ``(V_r, H)``, this rank's contiguous rows of the LM head, ``hidden``'s dtype.
        target: as :func:`vocab_parallel_token_log_probs`.
        bias_shard: None or ``(V_r,)``, this rank's slice of the bias.
        group, vocab_start_index: as :func:`vocab_parallel_cross_entropy`.
        temperature, softcap, ignore_index, logit_scale, return_entropy: as :func:`fusedce.linear_token_log_probs`.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"``: this rank's kernels (the matmuls are torch's).
        chunk_size: tokens per chunk of ``chunk_size x V_r`` logits; None: automatic.
        deterministic: None or a bool, accepted; this op is deterministic whatever its value.
        batch_invariant: bool; a token's results independent of the rest of the batch (one class per token; not
            with the three options below).
        return_stats, logits_dtype, top_k, top_p: as :func:`fusedce.linear_token_log_probs` (one class per
            token); thresholds and statistics exchanged as row numbers, never logits (docs/integrations.md).

    Returns:
        fp32 ``log_probs``, ``TokenLogProbs`` or (``return_stats``) ``TokenStats``; ``hidden``'s gradient
        complete on every rank, the slices' gradients this rank's.

    Raises:
        The errors of :func:`vocab_parallel_token_log_probs` and of :func:`vocab_parallel_linear_cross_entropy`
        for the shapes, dtypes, ``chunk_size`` and ``deterministic``.
    """
    call = rc.checked_linear_log_probs(hidden, weight_shard, target, bias_shard, temperature=temperature,
                                       softcap=softcap, logit_scale=logit_scale, ignore_index=ignore_index,
                                       return_entropy=return_entropy, return_stats=return_stats,
                                       chunk_size=chunk_size, method=None, deterministic=deterministic,
                                       sharded=True, top_k=top_k, top_p=top_p)
    opts, target = call.opts, call.target   # deterministic: checked; nothing to select (see the docstring)
    check_logits_dtype(logits_dtype, "chunked")
    rounded = logits_dtype == "input" and hidden.dtype != torch.float32   # no effect on fp32 operands
    sampled = call.truncated or bool(return_stats) or rounded
    if rounded and call.kclass:
        raise ValueError("logits_dtype='input' is not supported with a (..., K) target on a vocabulary-parallel "
                         "head (its K-class path forms fp32 logits); pass logits_dtype='float32'")
    ordered = invariant.check(batch_invariant)
    invariant.refuse(ordered and call.kclass, "a (..., K) target")
    invariant.refuse(ordered and sampled, "top_k / top_p, return_stats or logits_dtype='input' on a "
                     "vocabulary-parallel head (their PyTorch row path)")
    impl = backends.get(backend, hidden.device)
    invariant.check_backend(ordered, impl)
    layout = vocab_layout(weight_shard.shape[0], vocab_start_index, group, hidden.device)
    val.check_target_range(target, layout.n_classes, opts.ignore_index)

    if call.kclass:
        return _kclass(hidden, weight_shard, bias_shard, target, layout, opts, impl, chunk_size, return_entropy)
    shape, size = target.shape, hidden.shape[-1]
    n = math.prod(shape)
    if sampled:
        out = sampled_log_probs.linear_log_probs(
            hidden.reshape(n, size), weight_shard, bias_shard, target.reshape(-1), call.top_k, call.top_p, layout,
            opts, chunk_size, logits_dtype, return_entropy, bool(return_stats))
        log_probs, entropy, *stats = (t.reshape(shape) if t.numel() or not n else t for t in out)
        if return_stats:
            return TokenStats(log_probs, entropy if return_entropy else None, *stats)
        return TokenLogProbs(log_probs, entropy) if return_entropy else log_probs
    flat_hidden, flat_target, index = compact_rows(hidden.reshape(n, size), target.reshape(-1), opts.ignore_index)
    rows = None if chunk_size is None else int(chunk_size)   # None: the rule, decided in the loop op
    kept = flat_hidden.shape[0]
    if ordered:   # every chunk one shape: ROWS rows, the last padded with ignored zero rows
        flat_hidden, flat_target, _ = invariant.pad_rows(flat_hidden, flat_target, opts.ignore_index)
        rows = invariant.ROWS
    log_probs, entropy = _VocabParallelLinearLogProbs.apply(flat_hidden, weight_shard, bias_shard, flat_target,
                                                            layout, opts, rows, impl, return_entropy, ordered)
    if ordered:
        log_probs, entropy = log_probs[:kept], entropy[:kept] if return_entropy else entropy
    log_probs = scatter_rows(log_probs, index, n, 0.0)   # ignored rows: 0 in both outputs
    if return_entropy:
        entropy = scatter_rows(entropy, index, n, 0.0)
    return finish(log_probs, entropy, shape, return_entropy)


def _kclass(hidden, weight_shard, bias_shard, target, layout: VocabLayout, opts: LossOptions, impl, chunk_size,
           return_entropy: bool):
    """The ``(..., K)`` target (``kclass_log_probs.py``): rows whose K entries are all ignored compacted away."""
    size, K = hidden.shape[-1], target.shape[-1]
    n = math.prod(target.shape[:-1])
    flat_target = target.reshape(n, K)
    rep = entries(flat_target, opts, layout.n_classes).rep
    flat_hidden, _, index = compact_rows(hidden.reshape(n, size), rep, opts.ignore_index)
    if index is not None:
        flat_target = flat_target.index_select(0, index)
    rows = None if chunk_size is None else int(chunk_size)   # None: the rule, decided in the loop op
    log_probs, entropy = VocabParallelLinearLogProbsK.apply(flat_hidden, weight_shard, bias_shard, flat_target,
                                                            layout, opts, rows, impl, return_entropy)
    if index is not None:
        log_probs = log_probs.new_zeros(n, K).index_copy(0, index, log_probs)
        if return_entropy:
            entropy = scatter_rows(entropy, index, n, 0.0)
    return result(log_probs, entropy, target.shape, return_entropy)
