"""The checks of the ``top_k`` / ``top_p`` keywords of the RL log-prob ops (``rl/checks.py`` calls
``checked_truncation``): a Python number or a per-row tensor of the target's shape, ``top_k`` an integer >= 0 (0 or
None: off), ``top_p`` a number in (0, 1] (1.0 or None: off)."""
from __future__ import annotations

import math
import numbers

import torch

from fusedce.core.validation import host_readable


def _tensor(name: str, value: torch.Tensor, target: torch.Tensor, integer: bool) -> torch.Tensor:
    kind = "an integer" if integer else "a floating-point"
    ok = (not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool) if integer \
        else value.is_floating_point()
    if not ok:
        raise TypeError(f"{name} as a per-row tensor must have {kind} dtype, got {value.dtype}")
    if value.requires_grad and torch.is_grad_enabled():
        raise TypeError(f"{name} is a sampling setting and gets no gradient, but it requires grad; pass "
                        f"{name}.detach()")
    if value.shape != target.shape:
        raise ValueError(f"{name} as a per-row tensor must have the target's shape {tuple(target.shape)} (one "
                         f"value per token), got {tuple(value.shape)}")
    if value.device != target.device:
        raise ValueError(f"{name} is on {value.device} but target is on {target.device}; move it to the target's "
                         "device")
    if value.numel() and host_readable(value):
        bad = (value < 0) if integer else ~((value > 0) & (value <= 1))   # NaN is bad too
        if bool(bad.any()):   # the one sync of this argument
            flat = int(bad.reshape(-1).nonzero()[0, 0])
            pos = [int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(value.shape))]
            want = "an integer >= 0 (0: off)" if integer else "in (0, 1] (1.0: off)"
            raise ValueError(f"{name}{pos} = {value.reshape(-1)[flat].item()}: each {name} must be {want}")
    return value


def _top_k(top_k, target: torch.Tensor):
    if top_k is None:
        return None
    if isinstance(top_k, torch.Tensor):
        return _tensor("top_k", top_k, target, True)
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be an int >= 0 (0 or None: off) or a per-row integer tensor of the target's "
                        f"shape, got {type(top_k).__name__} {top_k!r}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 or None: off), got {top_k}")
    return int(top_k) or None


def _top_p(top_p, target: torch.Tensor):
    if top_p is None:
        return None
    if isinstance(top_p, torch.Tensor):
        return _tensor("top_p", top_p, target, False)
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"top_p must be a number in (0, 1] (1.0 or None: off) or a per-row floating-point tensor "
                        f"of the target's shape, got {type(top_p).__name__} {top_p!r}")
    top_p = float(top_p)
    if math.isnan(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1.0 or None: off; a mass, not a percentage), got {top_p}")
    return None if top_p == 1.0 else top_p


def checked_truncation(top_k, top_p, target: torch.Tensor, kclass: bool, return_stats) -> tuple:
    """``(top_k, top_p)`` checked (module docstring); ``ValueError`` when either is on with a ``(..., K)``
    target or ``return_stats`` (whose statistics are of the full distribution)."""
    if kclass and (top_k is not None or top_p is not None):
        raise ValueError("top_k / top_p apply to a (...) target of one class per token, not the (..., K) form")
    top_k, top_p = _top_k(top_k, target), _top_p(top_p, target)
    if (top_k is not None or top_p is not None) and return_stats:
        raise ValueError("return_stats is not supported with top_k / top_p (TRL's statistics are of the full "
                         "softmax); call without return_stats")
    return top_k, top_p


def check_truncated_method(method, batch_invariant) -> None:
    """``ValueError`` for ``top_k`` / ``top_p`` with ``method="tiled"`` (the tiled kernels never hold a row's
    logits, which the kept set needs: ``method="chunked"`` does) or ``batch_invariant=True``."""
    if method == "tiled":
        raise ValueError("top_k / top_p need method='chunked' (or 'auto'): the tiled method never holds a row's "
                         "logits, which the kept set needs; got method='tiled'")
    if batch_invariant is True:
        raise ValueError("batch_invariant=True does not support top_k / top_p (their rows run through the "
                         "chunked PyTorch path); pass batch_invariant=False")
