"""The one entrance of every public op: ``@public_op(kind, ...)`` gives a public function its signature (the loss
options written into it when it takes ``**options``), its keyword hints, its autocast behaviour and its DTensor
handling, in this order from the inside out. A plain call (no forward-mode AD level, no tensor subclass, no
autocast) takes one inline test of each and goes straight to the function."""
from __future__ import annotations

import functools
import inspect
from typing import Optional, Sequence

import torch
import torch.autograd.forward_ad as _fwad

from fusedce.core.autocast import fp32_op, linear_op
from fusedce.core.dtensor import dtensor_op
from fusedce.core.options.signatures import with_loss_options
from fusedce.core.transforms import no_forward_ad

KINDS = ("logits", "linear", "integration")
ENTRANCE: dict = {}   # "module.name" -> kind, every op that went through public_op
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def public_name(fn) -> str:
    """The name a user calls ``fn`` by: ``fusedce.<name>``, ``fusedce.distributed.<name>`` or
    ``fusedce.nn.functional.<name>``."""
    for prefix in ("fusedce.distributed", "fusedce.nn.functional"):
        if fn.__module__.startswith(prefix):
            return f"{prefix}.{fn.__name__}"
    return f"fusedce.{fn.__name__}"


def _plain(values) -> bool:
    """No value is a tensor subclass (a DTensor among them): the DTensor layer would pass the call through."""
    return all(type(v) in _PLAIN or not isinstance(v, torch.Tensor) for v in values)


def _hint_checks(fn, hints: Optional[dict]) -> tuple:
    """``(position, name, hint)`` of each parameter of ``hints``."""
    names = list(inspect.signature(fn).parameters)
    return tuple((names.index(name), name, hint) for name, hint in (hints or {}).items())


def _check_hints(fn, checks: tuple, args, kwargs) -> None:
    """``TypeError`` with the hint when a parameter of ``checks`` is filled both by position and by keyword
    (``weight`` of :func:`fusedce.linear_cross_entropy` is the LM head, not ``ce_weight``)."""
    for position, name, hint in checks:
        if len(args) > position and name in kwargs:
            raise TypeError(f"{fn.__name__}() got multiple values for argument {name!r}: {hint}")


def keyword_hints(fn, hints: dict):
    """``fn`` with the keyword-hint check (``_check_hints``) in front."""
    checks = _hint_checks(fn, hints)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _check_hints(fn, checks, args, kwargs)
        return fn(*args, **kwargs)
    return wrapper


def _fast(fn, chain, hints: Optional[dict]):
    """``chain`` (the layered op) with a shortcut to ``fn`` for plain calls, which every layer passes through."""
    checks = _hint_checks(fn, hints)

    @functools.wraps(chain)
    def op(*args, **kwargs):
        if (torch.compiler.is_compiling() or getattr(_fwad, "_current_level", -1) >= 0
                or torch._C._is_any_autocast_enabled()
                or not (_plain(args) and _plain(kwargs.values()))):
            return chain(*args, **kwargs)
        _check_hints(fn, checks, args, kwargs)
        return fn(*args, **kwargs)

    return op


def public_op(kind: str, *, linear: Optional[Sequence[Sequence[str]]] = None, hints: Optional[dict] = None):
    """Decorator: the one entrance of a public op (module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"public_op: kind must be one of {KINDS}, got {kind!r}")
    if linear is not None and kind != "linear":
        raise ValueError("public_op: linear= applies to kind='linear' only")

    def decorate(fn):
        params = list(inspect.signature(fn).parameters.values())
        if params and params[-1].kind is inspect.Parameter.VAR_KEYWORD and params[-1].name == "options":
            fn = with_loss_options(fn)
        op = keyword_hints(fn, hints) if hints else fn
        if kind == "logits":
            op = fp32_op(op)
        elif kind == "linear":
            op = linear_op(op, None if linear is None else tuple(tuple(g) for g in linear))
        if kind != "integration":
            op = _fast(fn, no_forward_ad(dtensor_op(op), public_name(fn)), hints)
        op.__fusedce_entrance__ = kind
        ENTRANCE[f"{fn.__module__}.{fn.__qualname__}"] = kind
        return op

    return decorate
