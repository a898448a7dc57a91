"""Public RL functions: per-token log-probabilities and entropy, from logits or from the hidden states."""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import backends, validation as val
from .autocast import fp32_op, linear_op
from .dtensor import dtensor_op
from .functional import rows_view
from .types import TokenLogProbs


def _backend(backend, device: torch.device, entry: str):
    """The backend module, which must have ``entry`` (the CuTe backend has no entropy kernels yet)."""
    impl = backends.get(backend, device)
    if not hasattr(impl, entry):
        raise RuntimeError(f"backend {backend!r} has no {entry} (no entropy kernels yet); use 'triton' or 'torch'")
    return impl


def _result(log_probs, entropy, shape, return_entropy: bool):
    log_probs = log_probs.reshape(shape)
    if not return_entropy:
        return log_probs
    return TokenLogProbs(log_probs, entropy.reshape(shape))


@dtensor_op   # replicated DTensors: computed on their local tensors (dtensor.py)
@fp32_op   # under autocast: fp32 math, as the loss
def token_log_probs(logits: torch.Tensor, target: torch.Tensor, *, temperature: float = 1.0,
                    softcap: Optional[float] = None, ignore_index: int = -100, return_entropy: bool = False,
                    backend: Optional[str] = None) -> Union[torch.Tensor, TokenLogProbs]:
    """Per-token ``log softmax(q)[target]`` (and the entropy of ``softmax(q)``) for policy-gradient RL.

    ``z = softcap * tanh(logits / softcap)`` when ``softcap`` is given (else ``z = logits``), then
    ``q = z / temperature``; ``log_probs[i] = q[i, t_i] - logsumexp(q[i])`` and ``entropy[i] =
    logsumexp(q[i]) - sum_c softmax(q[i])_c q[i, c]`` (the Shannon entropy, in nats).

    Args:
        logits: ``(..., V)`` float32 / bfloat16 / float16; any row stride (last dim not stride 1: one
            copy). Never modified.
        target: ``(...)`` = ``logits.shape[:-1]``, int64 or int32; ``ignore_index`` marks rows (prompt,
            padding) that get 0 in both outputs and exactly zero gradient.
        temperature: > 0, finite (the sampling temperature of the rollout).
        softcap: optional > 0, applied before the temperature (Gemma 2's final-logit softcapping).
        ignore_index: default -100.
        return_entropy: also return the entropy.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"``; None reads ``$FUSEDCE_BACKEND``.

    Returns:
        fp32 ``log_probs`` of ``target.shape``, or ``TokenLogProbs(log_probs, entropy)``. Both are
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
    val.check_float("logits", logits)
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the classes, last)")
    val.check_nonzero("logits", logits.shape, -1, "V")
    opts = val.log_prob_options(ignore_index, temperature, softcap)
    shape, n_classes = logits.shape[:-1], logits.shape[-1]
    val.check_target(target, shape, logits.device)
    target = val.widen_target(target, opts.ignore_index)
    val.check_flag("return_entropy", return_entropy)
    impl = _backend(backend, logits.device, "token_log_probs")
    val.check_target_range(target, n_classes, opts.ignore_index)
    log_probs, entropy = impl.token_log_probs(rows_view(logits, False), target.reshape(-1), opts,
                                              return_entropy)
    return _result(log_probs, entropy, shape, return_entropy)


@dtensor_op
@linear_op   # under autocast: matmul in the autocast dtype as F.linear, math fp32
def linear_token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                           bias: Optional[torch.Tensor] = None, *, temperature: float = 1.0,
                           softcap: Optional[float] = None, ignore_index: int = -100, return_entropy: bool = False,
                           chunk_size: Optional[int] = None, method: str = "auto",
                           backend: Optional[str] = None) -> Union[torch.Tensor, TokenLogProbs]:
    """:func:`token_log_probs` of ``hidden @ weight.T + bias`` without ever allocating BT x V logits.

    Args:
        hidden: ``(..., H)`` float32 / bfloat16 / float16; ``weight``: ``(V, H)`` and ``bias``
            (optional) ``(V,)`` of the same dtype. The logits are computed in that dtype with fp32
            accumulation (as ``F.linear``), the rest in fp32.
        target, temperature, softcap, ignore_index, return_entropy, backend: as in
            :func:`token_log_probs`.
        chunk_size, method: as in :func:`fusedce.linear_cross_entropy` (``"chunked"``: one chunk of
            logits at a time; ``"tiled"``: no tensor of V or more elements besides ``weight``,
            ``bias`` and their gradients). Ignored rows cost no matmul FLOPs (compacted first: one
            host sync per call, skipped under torch.compile / CUDA-graph capture).

    Returns:
        As :func:`token_log_probs`; gradients of ``hidden``, ``weight``, ``bias`` in their dtypes. The
        backward recomputes the logits (chunk by chunk, or tile by tile).

    Raises:
        The errors of :func:`token_log_probs` and of :func:`fusedce.linear_cross_entropy` for the
        shapes, ``chunk_size`` and ``method``.
    """
    opts = val.log_prob_options(ignore_index, temperature, softcap)
    val.check_linear(hidden, weight, target, bias, None, chunk_size)
    val.check_method(method, chunk_size)
    target = val.widen_target(target, opts.ignore_index)
    val.check_flag("return_entropy", return_entropy)
    shape, n_classes = hidden.shape[:-1], weight.shape[0]
    impl = _backend(backend, hidden.device, "linear_token_log_probs")
    val.check_target_range(target, n_classes, opts.ignore_index)
    log_probs, entropy = impl.linear_token_log_probs(
        hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), bias, opts, return_entropy,
        None if chunk_size is None else int(chunk_size), method)
    return _result(log_probs, entropy, shape, return_entropy)
