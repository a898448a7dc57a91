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

    ``z = softcap * tanh(s * logits / softcap)`` when ``softcap`` is given (else ``z = s * logits``;
    ``s`` = ``logit_scale``, as in the losses), then
    ``q = z / temperature``; ``log_probs[i] = q[i, t_i] - logsumexp(q[i])`` and ``entropy[i] =
    logsumexp(q[i]) - sum_c softmax(q[i])_c q[i, c]`` (the Shannon entropy, in nats).

    Args:
        logits: ``(..., V)`` float32 / bfloat16 / float16; any row stride (last dim not stride 1: one
            copy). Never modified.
        target: ``(...)`` = ``logits.shape[:-1]``, int64 or int32; ``ignore_index`` marks rows (prompt,
            padding) that get 0 in both outputs and exactly zero gradient. Or ``(..., K)`` (one more
            dimension, K >= 1): the log-probs of K classes per token (TRL's ``selective_log_softmax``
            with a ``(..., K)`` index; top-k distillation, ranking losses), ``log_probs[..., k] =
            q[t_k] - logsumexp(q)`` from one pass of the row statistics; ``ignore_index`` entries give 0
            and no gradient, a row whose K entries are all ignored is an ignored row (entropy 0);
            duplicate classes in a row are allowed (their gradients add). Not with ``return_stats``.
        temperature: > 0, finite (the sampling temperature of the rollout).
        softcap: optional > 0, applied before the temperature (Gemma 2's final-logit softcapping).
        logit_scale: > 0, multiplies the logits first (Cohere's ``logit_scale``, Granite's ``1 /
            logits_scaling``; TRL's fused head applies it the same way).
        ignore_index: default -100.
        return_entropy: also return the entropy.
        return_stats: return ``TokenStats(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``
            (TRL's per-token fields, defined in ``fusedce.TokenStats``; entropy None without
            ``return_entropy``); the three statistics have no gradient and cost nothing unless asked.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"``; None reads ``$FUSEDCE_BACKEND``.
        batch_invariant: as in :func:`fusedce.cross_entropy` (log-probs, entropy, statistics and the
            gradient's rows bitwise independent of the rest of the batch; free on logits; ``ValueError``
            with a ``(..., K)`` target or ``backend="cute"``).
        top_k, top_p: the sampler's truncation (``docs/contract.md``, "Top-k / top-p"): an int >= 0 / a
            number in (0, 1], or per-row tensors of ``target.shape`` (integer / floating); 0 / 1.0 / None:
            off. Then the log-probs and entropy are those of the renormalized kept set (temperature, then
            top-k, then top-p), gradients through the kept classes only, ``-inf`` (zero gradient) for a
            target outside its kept set. ``ValueError`` with a ``(..., K)`` target, ``return_stats`` or
            ``batch_invariant``.

    Returns:
        fp32 ``log_probs`` of ``target.shape`` (with a ``(..., K)`` target: ``(..., K)``, and the entropy
        ``(...)``), ``TokenLogProbs(log_probs, entropy)``, or (with
        ``return_stats``) ``TokenStats``. Both are
        differentiable with any upstream gradients (e.g. ``-(advantage * log_probs).sum() - beta *
        entropy.mean()``); the gradient of ``logits`` has their dtype and shape. Memory: the forward
        keeps O(BT) statistics; the backward writes one ``logits``-shaped gradient.

    Raises:
        TypeError / ValueError / IndexError / RuntimeError: as :func:`fusedce.cross_entropy` (shapes,
            dtypes, devices, a target neither ``ignore_index`` nor in [0, V), backends), plus
            ``ValueError`` for a ``temperature`` that is not a finite number > 0 or whose inverse is
            not a normal fp32 number, or a ``softcap / temperature`` beyond fp32's range, and
            ``RuntimeError`` for ``backend="cute"`` (no entropy kernels yet).
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
        hidden: ``(..., H)`` float32 / bfloat16 / float16; ``weight``: ``(V, H)`` and ``bias``
            (optional) ``(V,)`` of the same dtype. The logits are fp32 (``logits_dtype``), the rest
            fp32 too.
        target, temperature, softcap, logit_scale, ignore_index, return_entropy, return_stats, backend:
            as in :func:`token_log_probs` (the statistics come from the same pass as the log-probs with
            ``"tiled"``, from each chunk's logits right after its loss with ``"chunked"``).
        chunk_size, method: as in :func:`fusedce.linear_cross_entropy` (``"chunked"``: one chunk of
            logits at a time; ``"tiled"``: no tensor of V or more elements besides ``weight``,
            ``bias`` and their gradients). Ignored rows cost no matmul FLOPs (compacted first: one
            host sync per call, skipped under torch.compile / CUDA-graph capture).
        deterministic: as in :func:`fusedce.linear_cross_entropy` (None follows
            ``torch.are_deterministic_algorithms_enabled()``; the tiled Triton backward then runs
            without atomics; with a ``(..., K)`` target the tiled method then also adds the K classes'
            weight-gradient terms by a sorted segment sum, one more host sync, instead of ``index_add_``).
        logits_dtype: ``"float32"`` (default): the logits are formed in fp32 from the operands' values
            (products of bf16 / fp16 values are exact in fp32, summed in fp32; no fp32 copy of the weight:
            ``lm_head/fp32_linear.py``), so bf16 / fp16 results are within fp32 rounding of float64 of
            the same values; ``"input"``: rounded to ``hidden``'s dtype first, as ``F.linear`` (the stock
            composition's values, for exact parity with it). No effect on fp32 operands.
        batch_invariant: as in :func:`fusedce.linear_cross_entropy` (log-probs, entropy, statistics and
            ``hidden``'s gradient rows bitwise independent of the rest of the batch; either method, one
            class per token: ``ValueError`` with a ``(..., K)`` target).
        top_k, top_p: as in :func:`token_log_probs`; with ``method="chunked"`` (or ``"auto"``; ``"tiled"``:
            ``ValueError``), one chunk of logits at a time, on every backend (PyTorch ops on each chunk).
        A ``(..., K)`` target with ``"tiled"`` also computes the K target logits from gathered rows of
            ``weight`` (fp32 products, at most 2^22 elements at a time, or one row's K x H) and rounds
            the hidden gradient a second time in bf16 / fp16 (``rl/kclass_head.py``).

    Returns:
        As :func:`token_log_probs`; gradients of ``hidden``, ``weight``, ``bias`` in their dtypes. The
        backward recomputes the logits (chunk by chunk, or tile by tile).

    Raises:
        The errors of :func:`token_log_probs` and of :func:`fusedce.linear_cross_entropy` for the
        shapes, ``chunk_size``, ``method``, ``deterministic`` and ``logits_dtype``.
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
