"""What fusedce does under torch's function transforms and tracers, said in one place."""
from __future__ import annotations

import functools

import torch
import torch._guards  # noqa: F401  (imported by torch itself: no cost)
import torch.autograd.forward_ad as _fwad
import torch.fx._symbolic_trace  # noqa: F401  (likewise)


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


def values_unavailable(*tensors) -> bool:
    """Whether the values of ``tensors`` (None entries ignored) cannot be read on the host: one of them is on the meta
    device or a fake tensor (FSDP2's meta initialisation, memory estimators), or a fake or proxy mode is active
    (``make_fx`` in any mode, ``aot_function``, non-strict ``torch.export``), or ``torch.fx.symbolic_trace`` is
    tracing."""
    key = torch._C._TorchDispatchModeKey
    if (torch._C._get_dispatch_mode(key.PROXY) is not None
            or torch._C._get_dispatch_mode(key.FAKE) is not None):
        return True
    present = [t for t in tensors if isinstance(t, torch.Tensor)]
    if any(t.device.type == "meta" for t in present):
        return True
    if any(type(t) is not torch.Tensor for t in present) and torch._guards.detect_fake_mode(present) is not None:
        return True
    return torch.fx._symbolic_trace.is_fx_symbolic_tracing()
