"""``torch.autocast`` at the public entry points: every op behaves as the stock composition does under it."""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Optional

import torch


def autocast_device_type(t) -> Optional[str]:
    """``t``'s device type when ``t`` is a tensor and autocast is enabled for that device type, else None."""
    if not isinstance(t, torch.Tensor):
        return None
    device_type = t.device.type
    if not _autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return device_type


def _autocast_available(device_type: str) -> bool:
    """Whether autocast exists for ``device_type``."""
    if device_type in ("cpu", "cuda"):
        return True
    return torch.amp.is_autocast_available(device_type)


def disabled(device_type: Optional[str]):
    """A context manager that disables autocast for ``device_type`` (None: does nothing)."""
    return contextlib.nullcontext() if device_type is None else torch.autocast(device_type, enabled=False)


def _cast(t, device_type: str, dtype: torch.dtype):
    """Autocast's rule for a lower-precision op's input: a float tensor (not float64) on its device type is cast."""
    if (isinstance(t, torch.Tensor) and t.device.type == device_type and t.is_floating_point()
            and t.dtype not in (torch.float64, dtype)):
        return t.to(dtype)
    return t


def linear_inputs(hidden, weight, bias):
    """``(hidden, weight, bias)`` as autocast would hand them to ``F.linear`` (differentiable casts)."""
    device_type = autocast_device_type(hidden)
    if device_type is None:
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(_cast(t, device_type, dtype) for t in (hidden, weight, bias))


def fp32_op(fn):
    """Decorator for an op on logits (its first parameter): run with autocast off, as ``F.cross_entropy`` is fp32."""
    first = next(iter(inspect.signature(fn).parameters))

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device_type = autocast_device_type(args[0] if args else kwargs.get(first))
        if device_type is None:
            return fn(*args, **kwargs)
        with disabled(device_type):
            return fn(*args, **kwargs)

    return wrapper


def backward_formula(fn):
    """Decorator for an autograd backward formula: run it with autocast disabled for its first tensor's device type."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        device_type = autocast_device_type(first)
        if device_type is None:
            return fn(*args, **kwargs)
        with disabled(device_type):
            return fn(*args, **kwargs)

    return wrapper


def linear_op(fn, groups=None):
    """Decorator for a linear op: cast each ``(hidden, weight, bias)`` group (default parameters 1, 2, 4) with
    :func:`linear_inputs`, then run the op with autocast disabled."""
    names = list(inspect.signature(fn).parameters)
    groups = groups or ((names[0], names[1], names[3]),)
    slots = tuple(tuple((names.index(n), n) for n in group) for group in groups)   # (position, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = slots[0][0]
        device_type = autocast_device_type(args[first[0]] if len(args) > first[0] else kwargs.get(first[1]))
        if device_type is None:
            return fn(*args, **kwargs)
        call_args, kwargs = list(args), dict(kwargs)
        for group in slots:
            given = [call_args[i] if i < len(call_args) else kwargs.get(name) for i, name in group]
            for (index, name), value in zip(group, linear_inputs(*given)):
                if index < len(call_args):
                    call_args[index] = value
                elif name in kwargs:
                    kwargs[name] = value
        with disabled(device_type):
            return fn(*call_args, **kwargs)

    return wrapper
