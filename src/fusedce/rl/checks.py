"""The one checked call of the RL log-prob ops (``checked_log_probs``, ``checked_linear_log_probs``), for the
one-class and the K-class target alike, before any kernel."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from fusedce.core import validation as val
from fusedce.core.options import LossOptions, check_flag, deterministic_mode, log_prob_options
from fusedce.lm_head.head import check_method
from fusedce.rl.truncation_checks import checked_truncation


@dataclasses.dataclass(frozen=True)
class LogProbsCall:
    """The checked arguments of an RL log-prob op."""

    opts: LossOptions                # log_prob_options: the temperature folded into scale and softcap
    lead: torch.Size                 # the tokens' leading shape
    target: torch.Tensor             # (*lead) or, K-class form, (*lead, K); int64-safe (its range: the op's)
    kclass: bool                      # the K-class form (rl/kclass.py)
    deterministic: bool = False
    top_k: object = None             # None (off), an int >= 1, or a per-row integer tensor (rl/truncation_checks.py)
    top_p: object = None             # None (off), a float in (0, 1), or a per-row float tensor

    @property
    def truncated(self) -> bool:
        """Whether ``top_k`` / ``top_p`` ask for the sampler's truncated distribution (``rl/truncated_head.py``)."""
        return self.top_k is not None or self.top_p is not None


def is_kclass(data: torch.Tensor, target) -> bool:
    """Whether ``target`` asks for the K-class form: one more dimension than ``data``'s leading ones."""
    return isinstance(target, torch.Tensor) and target.dim() == data.dim()


def _check_kclass(target: torch.Tensor, shape, device, return_stats) -> None:
    val.check_target(target, (*shape, target.shape[-1]), device)
    if target.shape[-1] == 0:
        raise ValueError(f"target of shape {tuple(target.shape)}: the K-class form (..., K) needs K >= 1")
    if return_stats:
        raise ValueError("return_stats is not supported with a (..., K) target (TRL's statistics are per "
                         "token of one target); pass a (...) target")


def _flags(kclass: bool, return_entropy, return_stats) -> None:
    check_flag("return_entropy", return_entropy)
    if not kclass:
        check_flag("return_stats", return_stats)


def checked_log_probs(logits, target, *, temperature, softcap, logit_scale, ignore_index, return_entropy,
                      return_stats=False, name: str = "logits", sharded: bool = False, top_k=None,
                      top_p=None) -> LogProbsCall:
    """The checks of an RL op on logits (``sharded``: a vocabulary slice ``logits_shard``, possibly empty); the
    target is widened to int64 when ``ignore_index`` needs it."""
    val.check_not_swapped(name, logits, target, f"pass ({name}, target)")
    val.check_float(name, logits)
    if logits.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension (the classes, last)")
    if not sharded:
        val.check_nonzero(name, logits.shape, -1, "V")
    opts = log_prob_options(ignore_index, temperature, softcap, logit_scale)
    lead = logits.shape[:-1]
    kclass = is_kclass(logits, target)
    if kclass:
        _check_kclass(target, lead, logits.device, return_stats)
    else:
        val.check_target(target, lead, logits.device, lambda t: f"{val.class_dim_hint(tuple(logits.shape), t)}"
                         f"; or a (..., K) target of {len(lead) + 1} dimensions, K target ids per token", data=name)
    target = val.widen_target(target, opts.ignore_index)
    _flags(kclass, return_entropy, return_stats)
    top_k, top_p = checked_truncation(top_k, top_p, target, kclass, return_stats)
    return LogProbsCall(opts, lead, target, kclass, top_k=top_k, top_p=top_p)


def checked_linear_log_probs(hidden, weight, target, bias, *, temperature, softcap, logit_scale, ignore_index,
                             return_entropy, return_stats=False, chunk_size=None, method: Optional[str] = "auto",
                             deterministic=None, sharded: bool = False, top_k=None, top_p=None) -> LogProbsCall:
    """The checks of an RL op on the LM head (``sharded``: the vocab-parallel one, ``weight_shard`` /
    ``bias_shard``, no ``method``)."""
    opts = log_prob_options(ignore_index, temperature, softcap, logit_scale)
    deterministic = deterministic_mode(deterministic)
    kclass = is_kclass(hidden, target)
    names = ("weight_shard", "bias_shard", "ce_weight_shard") if sharded else ("weight", "bias", "ce_weight")
    if kclass:
        if target.shape[-1] == 0:
            raise ValueError(f"target of shape {tuple(target.shape)}: the K-class form (..., K) needs K >= 1")
        val.check_linear(hidden, weight, target.select(-1, 0), bias, None, chunk_size, names=names, sharded=sharded,
                         probabilities=False)
        _check_kclass(target, hidden.shape[:-1], hidden.device, return_stats)
    else:
        val.check_linear(hidden, weight, target, bias, None, chunk_size, names=names, sharded=sharded,
                         probabilities=False)
    if not sharded:
        check_method(method, chunk_size)
    target = val.widen_target(target, opts.ignore_index)
    _flags(kclass, return_entropy, return_stats)
    top_k, top_p = checked_truncation(top_k, top_p, target, kclass, return_stats)
    return LogProbsCall(opts, hidden.shape[:-1], target, kclass, deterministic, top_k, top_p)
