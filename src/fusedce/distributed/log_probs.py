"""Vocab-parallel per-token log-probabilities and entropy (RL) on logits split by vocabulary over ranks."""
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
from fusedce.core.options import LossOptions
from fusedce.core.types import TokenLogProbs
from fusedce.distributed.exchange import Partials, exchange
from fusedce.distributed.layout import VocabLayout, vocab_layout
from fusedce.distributed.kclass_log_probs import VocabParallelLogProbsK
from fusedce.distributed.shard_rows import Columns, shard_forward, shard_grad
from fusedce.rl.kclass import result


def exchange_log_probs(partials: Partials, target: torch.Tensor, layout: VocabLayout, opts: LossOptions,
                       cols: Columns, ordered: bool = False):
    """The collectives on this rank's filled ``partials`` -> ``(log_probs, entropy, lse, lse_lo)`` (n,) fp32 each,
    global and identical on every rank (0 on ignored rows; ``entropy`` empty without the ``tsum`` column)."""
    out = exchange(partials, target, None, layout, opts, cols, ordered)
    log_probs = torch.where(opts.kept(target), -out.loss, 0.0)   # +0.0 on ignored rows, as token_log_probs
    entropy = out.lse.new_empty(0) if out.entropy is None else out.entropy
    return log_probs, entropy, out.lse, out.lse_lo


def upstreams(grad_log_probs, grad_entropy, like: torch.Tensor, want_entropy: bool):
    """(grad_row, grad_entropy) for ``slice_grad``: the loss is ``-log_probs``, so ``grad_row = -g``."""
    grad_row = like.new_zeros(()).expand(like.shape) if grad_log_probs is None else -grad_log_probs.float()
    return grad_row, (grad_entropy if want_entropy else None)


def finish(log_probs: torch.Tensor, entropy: torch.Tensor, shape, return_entropy: bool):
    """Reshape to ``target.shape``: the log-probs, or ``TokenLogProbs``."""
    log_probs = log_probs.reshape(shape)
    return TokenLogProbs(log_probs, entropy.reshape(shape)) if return_entropy else log_probs


class _VocabParallelLogProbs(torch.autograd.Function):
    """(n, V_r) logits slice -> global per-row log-probs (n,) fp32 and entropy (n,) fp32 (empty unless
    asked), both differentiable."""

    @staticmethod
    def forward(ctx, logits, target, layout: VocabLayout, opts: LossOptions, impl, want_entropy: bool):
        cols = Columns(False, False, want_entropy)
        p = Partials.allocate(logits.shape[0], cols, False, logits.device)
        p.key, p.zmax, p.sums[:] = shard_forward(impl, logits, target, None, layout, opts, cols)
        log_probs, entropy, lse, lse_lo = exchange_log_probs(p, target, layout, opts, cols)
        ctx.save_for_backward(logits, target, lse, lse_lo, entropy)
        ctx.layout, ctx.opts, ctx.impl, ctx.want_entropy = layout, opts, impl, want_entropy
        return log_probs, entropy

    @staticmethod
    @backward_formula
    def backward(ctx, grad_log_probs, grad_entropy):
        check_backward_allowed(ctx, "fusedce.distributed.vocab_parallel_token_log_probs")
        logits, target, lse, lse_lo, entropy = ctx.saved_tensors
        grad_row, k = upstreams(grad_log_probs, grad_entropy, lse, ctx.want_entropy)
        grad = shard_grad(ctx.impl, logits, target, None, None, None, lse, lse_lo, grad_row, None, ctx.layout,
                          ctx.opts, grad_entropy=k, entropy=entropy if k is not None else None)
        return grad, None, None, None, None, None


@public_op("logits")
def vocab_parallel_token_log_probs(
    logits_shard: torch.Tensor, target: torch.Tensor, *, group=None, vocab_start_index: Optional[int] = None,
    temperature: float = 1.0, softcap: Optional[float] = None, ignore_index: int = -100,
    return_entropy: bool = False, backend: Optional[str] = None, logit_scale: float = 1.0,
) -> Union[torch.Tensor, TokenLogProbs]:
    """:func:`fusedce.token_log_probs` on logits split by vocabulary over the ranks of ``group``.

    ``log_probs[i] = q[i, t_i] - logsumexp(q[i])`` and the entropy over the global vocabulary, ``q`` as
    :func:`fusedce.token_log_probs`; replicated outputs, each rank's slice gradient. Semantics:
    docs/contract.md, "Integrations"; collectives: docs/integrations.md, "Collectives".

    Args:
        logits_shard: ``(..., V_r)`` float32 / bfloat16 / float16, this rank's contiguous vocabulary slice.
        target: ``(...)`` int64 / int32 global class ids, identical on every rank, or ``(..., K)``: K classes
            per token.
        group, vocab_start_index: as :func:`vocab_parallel_cross_entropy`.
        temperature, softcap, ignore_index, logit_scale, return_entropy: as :func:`fusedce.token_log_probs`.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"``: this rank's kernels.

    Returns:
        fp32 ``log_probs`` of ``target.shape`` or ``TokenLogProbs(log_probs, entropy)``, differentiable.

    Raises:
        The errors of :func:`fusedce.token_log_probs` (the range against the global V) and of
        :func:`vocab_parallel_cross_entropy`'s layout.
    """
    call = rc.checked_log_probs(logits_shard, target, temperature=temperature, softcap=softcap,
                                logit_scale=logit_scale, ignore_index=ignore_index, return_entropy=return_entropy,
                                name="logits_shard", sharded=True)
    opts, target = call.opts, call.target
    shape, n_local, device = logits_shard.shape[:-1], logits_shard.shape[-1], logits_shard.device
    impl = backends.get(backend, device)
    layout = vocab_layout(n_local, vocab_start_index, group, device)
    val.check_target_range(target, layout.n_classes, opts.ignore_index)

    rows = logits_shard.reshape(math.prod(shape), n_local)
    if rows.stride(-1) != 1 and n_local > 1:
        rows = rows.contiguous()  # one copy, only when the class dim is strided
    if call.kclass:   # (..., K) classes: distributed/kclass_log_probs.py
        log_probs, entropy = VocabParallelLogProbsK.apply(rows, target.reshape(-1, target.shape[-1]), layout, opts,
                                                          impl, return_entropy)
        return result(log_probs, entropy, target.shape, return_entropy)
    log_probs, entropy = _VocabParallelLogProbs.apply(rows, target.reshape(-1), layout, opts, impl,
                                                      return_entropy)
    return finish(log_probs, entropy, shape, return_entropy)
