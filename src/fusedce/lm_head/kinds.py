"""The registry of chunk-loop kinds and its two custom ops, ``fusedce_lm::loop_forward`` and
``fusedce_lm::loop_backward``: a tracer sees one node per loop whatever the token count (the loop, its rows rule
and its gathers run inside, on the real sizes). A kind is a class with ``forward`` / ``backward`` and their
``*_fake`` (output shapes only), each taking one :class:`Args`; the upper packages register theirs on import.
Ops and kinds: ``docs/lm_head.md``."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from fusedce.core.opaque import opaque_op
from fusedce.core.options import LossOptions

Tensor = torch.Tensor
KINDS: dict = {}


class Args(NamedTuple):
    """One call's arguments: tensors (None where absent), ints (flags as 0 / 1), floats, comma-separated words
    (backend, logits dtype, ...) and one dtype (the accumulation's)."""
    t: list
    i: list
    f: list
    words: str
    dtype: torch.dtype

    def opts(self) -> LossOptions:
        """The ``LossOptions`` sent by :func:`loss_args`: ``ignore_index`` at ``i[0]``, the scalars ``f``."""
        return LossOptions.from_op_args(self.i[0], self.f)

    def word(self, k: int) -> str:
        return self.words.split(",")[k]


def register(name: str):
    """Class decorator: the kind ``name``."""
    def put(cls):
        KINDS[name] = cls
        return cls
    return put


def _op(method: str):
    """The op ``fusedce_lm::loop_<method>`` (its fake the kind's ``<method>_fake``) and its caller."""
    def body(kind: str, tensors: list[Optional[Tensor]], ints: list[int], floats: list[float], words: str,
             dtype: torch.dtype) -> list[Tensor]:
        return getattr(KINDS[kind], method)(Args(tensors, ints, floats, words, dtype))

    op = opaque_op(f"fusedce_lm::loop_{method}", mutates_args=(), observable=True)(body)
    op.register_fake(lambda kind, *args: getattr(KINDS[kind], method + "_fake")(Args(*args)))

    def call(kind: str, tensors, ints=(), floats=(), words: str = "", dtype: torch.dtype = torch.float32) -> list:
        return op(kind, list(tensors), [int(i) for i in ints], [float(f) for f in floats], words, dtype)
    call.__doc__ = f"The kind's {method} pass through ``fusedce_lm::loop_{method}`` (a list of tensors)."
    return call


forward, backward = _op("forward"), _op("backward")   # kinds.forward(kind, tensors, ints, floats, words, dtype)


def loss_args(opts: LossOptions, *ints) -> tuple:
    """``(ints, floats)`` of a kind that reads ``Args.opts()``: ``[ignore_index, *ints]``, the scalars."""
    ignore_index, scalars = opts.op_args()
    return [ignore_index, *ints], scalars
