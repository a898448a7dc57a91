"""The K-class form of the RL ops: ``token_log_probs`` / ``linear_token_log_probs`` with a ``target`` of
shape ``(..., K)`` (the log-probs of K given classes per token, as TRL's ``selective_log_softmax``
gathers them). Validation and shapes here; the math in ``rl/multi_head.py``."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce import backends
from fusedce.core import validation as val
from fusedce.rl import multi_head as head_multi
from fusedce.lm_head.method import check_method, resolve_method
from fusedce.core.options import check_flag
from fusedce.core.options import LossOptions
from fusedce.core.types import TokenLogProbs


def is_multi(data: torch.Tensor, target) -> bool:
    """Whether ``target`` asks for the K-class form: one more dimension than ``data``'s leading ones."""
    return isinstance(target, torch.Tensor) and target.dim() == data.dim()


def _check(target: torch.Tensor, shape, device, return_stats) -> None:
    val.check_target(target, (*shape, target.shape[-1]), device)
    if target.shape[-1] == 0:
        raise ValueError(f"target of shape {tuple(target.shape)}: the K-class form (..., K) needs K >= 1")
    if return_stats:
        raise ValueError("return_stats is not supported with a (..., K) target (TRL's statistics are per "
                         "token of one target); pass a (...) target")


def _result(log_probs, entropy, target_shape, return_entropy: bool):
    log_probs = log_probs.reshape(target_shape)
    if not return_entropy:
        return log_probs
    return TokenLogProbs(log_probs, entropy.reshape(target_shape[:-1]))


def token_log_probs(logits: torch.Tensor, target: torch.Tensor, opts: LossOptions, return_entropy: bool,
                    return_stats: bool, backend: Optional[str]):
    """``fusedce.token_log_probs`` for a ``(..., K)`` target (``logits`` already checked)."""
    shape, n_classes = logits.shape[:-1], logits.shape[-1]
    _check(target, shape, logits.device, return_stats)
    target = val.widen_target(target, opts.ignore_index)
    check_flag("return_entropy", return_entropy)
    impl = backends.get(backend, logits.device, entropy=True)
    val.check_target_range(target, n_classes, opts.ignore_index)
    return _result(*log_probs_rows(impl, logits, target, opts, return_entropy), target.shape, return_entropy)


def log_probs_rows(impl, logits: torch.Tensor, classes: torch.Tensor, opts: LossOptions, return_entropy: bool):
    """The internal K-class op on CHECKED arguments (no check, no entrance; the top-k distillation calls
    it): ``logits`` ``(..., V)``, ``classes`` ``(..., K)`` int64-safe, in [0, V) or ``ignore_index``,
    ``impl`` the backend (``backends.get(..., entropy=True)``). Returns ``(log_probs (N, K), entropy (N,)
    or None)`` in fp32, N the number of tokens; differentiable w.r.t. ``logits``."""
    n_classes = logits.shape[-1]
    flat = logits.reshape(-1, n_classes)
    if flat.stride(-1) != 1 and n_classes > 1:
        flat = flat.contiguous()
    return head_multi.token_log_probs_multi(impl.CHUNK_CE, flat, classes.reshape(-1, classes.shape[-1]), opts,
                                            return_entropy)


def linear_token_log_probs(hidden, weight, target, bias, opts: LossOptions, return_entropy: bool,
                           return_stats: bool, chunk_size, method: str, backend: Optional[str],
                           deterministic: bool):
    """``fusedce.linear_token_log_probs`` for a ``(..., K)`` target."""
    if target.shape[-1] == 0:
        raise ValueError(f"target of shape {tuple(target.shape)}: the K-class form (..., K) needs K >= 1")
    val.check_linear(hidden, weight, target.select(-1, 0), bias, None, chunk_size)
    _check(target, hidden.shape[:-1], hidden.device, return_stats)
    check_method(method, chunk_size)
    target = val.widen_target(target, opts.ignore_index)
    check_flag("return_entropy", return_entropy)
    impl = backends.get(backend, hidden.device, entropy=True, tiled=resolve_method(method) == "tiled")
    val.check_target_range(target, weight.shape[0], opts.ignore_index)
    out = linear_log_probs_rows(impl, hidden, weight, target, bias, opts, return_entropy, chunk_size, method,
                                deterministic)
    return _result(*out, target.shape, return_entropy)


def linear_log_probs_rows(impl, hidden, weight, classes, bias, opts: LossOptions, return_entropy: bool, chunk_size,
                          method: str, deterministic: bool):
    """The internal K-class op of the LM head on CHECKED arguments (no check, no entrance; the top-k
    distillation calls it): ``hidden`` ``(..., H)``, ``weight`` ``(V, H)``, ``bias`` ``(V,)`` or None,
    ``classes`` ``(..., K)`` as :func:`log_probs_rows`, ``impl`` from ``backends.get(..., entropy=True,
    tiled=...)``. Returns ``(log_probs (N, K), entropy (N,) or None)``."""
    return head_multi.linear_token_log_probs_multi(
        impl.CHUNK_CE, hidden.reshape(-1, hidden.shape[-1]), weight, classes.reshape(-1, classes.shape[-1]), bias,
        opts, return_entropy, None if chunk_size is None else int(chunk_size), method, tiled=impl.TILED_CE,
        deterministic=deterministic)
