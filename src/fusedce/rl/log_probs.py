"""Public RL functions: per-token log-probabilities and entropy, from logits or from the hidden states."""
from __future__ import annotations

from typing import Optional, Union

import torch

from fusedce.core.entrance import public_op
from fusedce import backends
from fusedce.rl import linear_head
from fusedce.rl import kclass
from fusedce.core import validation as val
from fusedce.lm_head import invariant
from fusedce.lm_head.head import check_logits_dtype, resolve_method
from fusedce.rl import checks as rc
from fusedce.rl.truncation_checks import check_truncated_method
from fusedce.rl import truncated_head
from fusedce.core.rows import rows_view
from fusedce.core.types import TokenLogProbs, TokenStats


def _result(out, shape, return_entropy: bool, return_stats: bool):
    log_probs, entropy, *stats = (t.reshape(shape) if t.numel() or not shape.numel() else t for t in out)
    if return_stats:
        return TokenStats(log_probs, entropy if return_entropy else None, *stats)
    if not return_entropy:
        return log_probs
    return TokenLogProbs(log_probs, entropy)


@public_op("logits")
def token_log_probs(logits: torch.Tensor, target: torch.Tensor, *, temperature: float = 1.0,
                    softcap: Optional[float] = None, logit_scale: float = 1.0, ignore_index: int = -100,
                    return_entropy: bool = False, return_stats: bool = False,
                    backend: Optional[str] = None, batch_invariant: bool = False, top_k=None, top_p=None
                    ) -> Union[torch.Tensor, TokenLogProbs, TokenStats]:
    """Per-token ``log softmax(q)[target]`` (and the entropy of ``softmax(q)``) for policy-gradient RL.

    ``z = softcap * tanh(s * logits / softcap)`` (else ``z = s * logits``; ``s`` = ``logit_scale``),
    ``q = z / temperature``; ``log_probs[i] = q[i, t_i] - logsumexp(q[i])``, ``entropy[i] = logsumexp(q[i]) -
    sum_c softmax(q[i])_c q[i, c]`` (nats). Semantics: docs/contract.md, "RL".

    Args:
        logits: ``(..., V)`` float32 / bfloat16 / float16; never modified.
        target: ``(...)`` int64 / int32 (``ignore_index`` rows give 0 and no gradient), or ``(..., K)``: the
            log-probs of K classes per token.
        temperature: finite > 0.
        softcap: None or > 0, applied before the temperature.
        logit_scale: > 0, multiplies the logits first.
        ignore_index: the ignored target value.
        return_entropy: also return the entropy.
        return_stats: return :class:`fusedce.TokenStats` (TRL's per-token fields; no gradient).
        backend: ``"auto"`` / ``"torch"`` / ``"triton"``; None reads ``$FUSEDCE_BACKEND``.
        batch_invariant: bool; each row's results bitwise independent of the rest of the batch.
        top_k, top_p: the sampler's truncation (docs/contract.md, "Top-k / top-p"); 0 / 1.0 / None: off.

    Returns:
        fp32 ``log_probs`` of ``target.shape``, ``TokenLogProbs(log_probs, entropy)``, or ``TokenStats``;
        differentiable with any upstream gradients.

    Raises:
        TypeError / ValueError / IndexError: as :func:`fusedce.cross_entropy`, plus ``ValueError`` for a bad
            ``temperature`` or ``softcap / temperature``, and for ``top_k`` / ``top_p`` with a ``(..., K)``
            target, ``return_stats`` or ``batch_invariant``.
        RuntimeError: ``backend="cute"`` (no entropy kernels).
    """
    call = rc.checked_log_probs(logits, target, temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                                ignore_index=ignore_index, return_entropy=return_entropy, return_stats=return_stats,
                                top_k=top_k, top_p=top_p)
    invariant.check(batch_invariant)
    if call.truncated:
        check_truncated_method("chunked", batch_invariant)
    impl = backends.get(backend, logits.device, entropy=True)
    invariant.check_backend(batch_invariant, impl)
    val.check_target_range(call.target, logits.shape[-1], call.opts.ignore_index)
    if call.truncated:
        out = truncated_head.token_log_probs(rows_view(logits, False), call.target.reshape(-1), call.top_k,
                                             call.top_p, call.opts, return_entropy)
        return _result(out, call.lead, return_entropy, False)
    if call.kclass:
        invariant.refuse(batch_invariant, "a (..., K) target")
        out = kclass.log_probs_rows(impl, logits, call.target, call.opts, return_entropy)
        return kclass.result(*out, call.target.shape, return_entropy)
    out = linear_head.token_log_probs(impl.CHUNK_CE, rows_view(logits, False), call.target.reshape(-1), call.opts,
                                      return_entropy, return_stats)
    return _result(out, call.lead, return_entropy, return_stats)


@public_op("linear")
def linear_token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                           bias: Optional[torch.Tensor] = None, *, temperature: float = 1.0,
                           softcap: Optional[float] = None, logit_scale: float = 1.0, ignore_index: int = -100,
                           return_entropy: bool = False, return_stats: bool = False,
                           chunk_size: Optional[int] = None, method: str = "auto",
                           backend: Optional[str] = None, deterministic: Optional[bool] = None,
                           logits_dtype: str = "float32", batch_invariant: bool = False, top_k=None,
                           top_p=None) -> Union[torch.Tensor, TokenLogProbs, TokenStats]:
    """:func:`token_log_probs` of ``hidden @ weight.T + bias`` without ever allocating BT x V logits.

    Args:
        hidden: ``(..., H)`` float32 / bfloat16 / float16.
        weight: ``(V, H)``, the hidden's dtype.
        target: as :func:`token_log_probs`, and so are ``temperature``, ``softcap``, ``logit_scale``,
            ``ignore_index``, ``return_entropy``, ``return_stats``, ``backend``, ``top_k``, ``top_p``.
        bias: None or ``(V,)``, the hidden's dtype.
        chunk_size, method, deterministic: as :func:`fusedce.linear_cross_entropy`; ``top_k`` / ``top_p``
            need ``method="chunked"`` or ``"auto"``.
        logits_dtype: ``"float32"`` (logits in fp32 from the operands' values) or ``"input"`` (rounded first,
            as ``F.linear``).
        batch_invariant: as :func:`fusedce.linear_cross_entropy`; one class per token only.

    Returns:
        As :func:`token_log_probs`; gradients of ``hidden``, ``weight``, ``bias`` in their dtypes.

    Raises:
        The errors of :func:`token_log_probs` and of :func:`fusedce.linear_cross_entropy` for the shapes,
        ``chunk_size``, ``method``, ``deterministic`` and ``logits_dtype``.
    """
    call = rc.checked_linear_log_probs(hidden, weight, target, bias, temperature=temperature, softcap=softcap,
                                       logit_scale=logit_scale, ignore_index=ignore_index,
                                       return_entropy=return_entropy, return_stats=return_stats,
                                       chunk_size=chunk_size, method=method, deterministic=deterministic,
                                       top_k=top_k, top_p=top_p)
    check_logits_dtype(logits_dtype, method)
    invariant.check(batch_invariant)
    if call.truncated:
        check_truncated_method(method, batch_invariant)
    impl = backends.get(backend, hidden.device, entropy=True, tiled=resolve_method(method) == "tiled")
    val.check_target_range(call.target, weight.shape[0], call.opts.ignore_index)
    if call.truncated:
        out = truncated_head.linear_token_log_probs(
            hidden.reshape(-1, hidden.shape[-1]), weight, call.target.reshape(-1), bias, call.top_k, call.top_p,
            call.opts, return_entropy, None if chunk_size is None else int(chunk_size), logits_dtype)
        return _result(out, call.lead, return_entropy, False)
    invariant.check_backend(batch_invariant, impl)
    if call.kclass:
        invariant.refuse(batch_invariant, "a (..., K) target")
        out = kclass.linear_log_probs_rows(impl, hidden, weight, call.target, bias, call.opts, return_entropy,
                                          chunk_size, method, call.deterministic, logits_dtype)
        return kclass.result(*out, call.target.shape, return_entropy)
    out = linear_head.linear_token_log_probs(
        impl.CHUNK_CE, hidden.reshape(-1, hidden.shape[-1]), weight, call.target.reshape(-1), bias, call.opts,
        return_entropy, None if chunk_size is None else int(chunk_size), method, return_stats, tiled=impl.TILED_CE,
        deterministic=call.deterministic, logits=logits_dtype, batch_invariant=batch_invariant)
    return _result(out, call.lead, return_entropy, return_stats)
