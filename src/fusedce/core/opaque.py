"""Opaque ops: a ``torch.library.custom_op`` that eager calls bypass."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _tracing_mode() -> bool:
    """A tracing dispatch mode is active: fake tensors, ``make_fx``'s proxy mode or functionalization (the
    modes ``torch.compile``, ``make_fx``, ``aot_function`` and ``torch.export`` trace under)."""
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(k) is not None for k in (keys.FAKE, keys.PROXY, keys.FUNCTIONAL))


def _plain_eager(args: Sequence, observable: bool = False) -> bool:
    """True when no tracer, mode or subclass would need the registered op: a direct call is equivalent."""
    if torch.compiler.is_compiling():
        return False
    if _tracing_mode() if observable else _get_current_dispatch_mode() is not None:
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN or a.is_meta):
            return False
        if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a):
            if not _plain_eager(a, observable):
                return False
    return True


class OpaqueOp:
    """A custom op (``self.op``) callable like its Python body; see the module docstring."""

    def __init__(self, name: str, fn: Callable, mutates_args: Sequence[str], observable: bool = False):
        self.fn, self.observable = fn, observable
        self.op = torch.library.custom_op(name, mutates_args=tuple(mutates_args))(fn)
        self.register_fake = self.op.register_fake

    def __call__(self, *args, **kwargs):
        if _plain_eager(args, self.observable) and _plain_eager(tuple(kwargs.values()), self.observable):
            with torch.no_grad():
                return self.fn(*args, **kwargs)
        return self.op(*args, **kwargs)


def opaque_op(name: str, *, mutates_args: Sequence[str] = (), observable: bool = False
              ) -> Callable[[Callable], OpaqueOp]:
    """``torch.library.custom_op(name, mutates_args=...)`` as an :class:`OpaqueOp` (decorator)."""
    return lambda fn: OpaqueOp(name, fn, mutates_args, observable)
