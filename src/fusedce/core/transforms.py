"""What fusedce does under torch's forward-mode AD (the public ops have a reverse-mode formula only)."""
from __future__ import annotations

import functools

import torch
import torch.autograd.forward_ad as _fwad


def _has_tangent(value) -> bool:
    if isinstance(value, torch.Tensor):
        return _fwad.unpack_dual(value).tangent is not None
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) and _fwad.unpack_dual(v).tangent is not None for v in value)
    return False


def no_forward_ad(fn, name: str):
    """Decorator: ``fn`` (the public op ``name``) raises ``NotImplementedError`` when a tensor argument
    carries a forward-mode tangent. Costs one integer compare when no dual level is open."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if getattr(_fwad, "_current_level", -1) >= 0 and not torch.compiler.is_compiling():
            if any(_has_tangent(v) for v in args) or any(_has_tangent(v) for v in kwargs.values()):
                raise NotImplementedError(
                    f"{name}: forward-mode AD (torch.func.jvp / jacfwd, torch.autograd.forward_ad) is not "
                    "supported by fusedce: its kernels have a reverse-mode formula only. Use reverse mode "
                    "(torch.func.grad / jacrev / vjp, torch.autograd.grad) instead.")
        return fn(*args, **kwargs)

    return wrapper
