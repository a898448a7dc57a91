"""What ``fusedce inspect`` compiles of the distillation kernels (``backends/triton/distill_launch.py``): their
constexpr code paths, and each launch built exactly as the launcher builds it (on meta tensors)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedce.core.options import LossFlags

DISTILL_TILED = ("distill_tiled_stats", "distill_tiled_jsd", "distill_tiled_grad", "distill_tiled_grad_hidden",
                 "distill_tiled_grad_weight")
DISTILL_KERNELS = ("distill_rows",) + DISTILL_TILED
HIDDEN = 4096


@dataclass(frozen=True)
class DistillVariant:
    """The options of one distillation launch (see the module docstring)."""

    beta: float = 0.0
    hard: bool = False
    cap: bool = False
    bias: bool = False
    grad: bool = False

    def knobs(self):
        from ...backends.triton.distill_launch import DistillKnobs
        return DistillKnobs(self.beta, 2.0 if self.hard else 1.0, 0.5 if self.hard else 0.0, -100,
                            30.0 if self.cap else None, 50.0 if self.cap else None, True)

    def flags(self) -> LossFlags:
        """No cross-entropy loss options (the report's rules read them): all off."""
        return LossFlags(**{f: False for f in LossFlags._fields})


def _v(beta=0.0, **kw) -> DistillVariant:
    return DistillVariant(beta, **kw)


_MODES = {"fkl": 0.0, "rkl": 1.0, "jsd": 0.5}


def _table(kernel: str, every: bool) -> dict:
    modes = ("jsd",) if kernel == "distill_tiled_jsd" else tuple(_MODES)
    extras = ("hard", "cap") + (("grad",) if kernel == "distill_rows" else ("bias",))
    out = {}
    for mode in modes:
        if every:
            for bits in range(1 << len(extras)):
                on = [e for i, e in enumerate(extras) if bits >> i & 1]
                out["+".join([mode] + on)] = _v(_MODES[mode], **{e: True for e in on})
        else:
            grad = kernel == "distill_rows"
            out[mode] = _v(_MODES[mode], grad=grad)
            out[mode + "+all"] = _v(_MODES[mode], hard=True, cap=True, bias=not grad, grad=grad)
    return out


VARIANTS = {k: _table(k, False) for k in DISTILL_KERNELS}


def every_variant(kernel: str) -> dict:
    return _table(kernel, True)


def launch(kernel: str, dtype: torch.dtype, vocab: int, variant: DistillVariant, rows: int):
    """``(kernel, grid, args, meta)`` the launcher would use, on meta tensors (student and teacher of
    ``dtype``; ``grad_factor`` an expanded stride-0 scalar, as the upstream gradient of a mean)."""
    from ...backends.triton import distill_launch as L

    def meta(*shape, dt=torch.float32):
        return torch.empty(*shape, dtype=dt, device="meta")

    target = meta(rows, dt=torch.int64)
    knobs = variant.knobs()
    grad_factor = meta(()).expand(rows)
    if kernel == "distill_rows":
        return L.rows_launch(meta(rows, vocab, dt=dtype), meta(rows, vocab, dt=dtype), target,
                             grad_factor if variant.grad else None, knobs, meta(rows),
                             meta(rows, vocab, dt=dtype) if variant.grad else None)
    bias = meta(vocab, dt=dtype) if variant.bias else None
    heads = L.Heads(meta(rows, HIDDEN, dt=dtype), meta(vocab, HIDDEN, dt=dtype), bias, meta(rows, HIDDEN, dt=dtype),
                    meta(vocab, HIDDEN, dt=dtype), bias)
    stats = meta(4, rows)
    if kernel in ("distill_tiled_stats", "distill_tiled_jsd"):
        launches = L.tiled_stats_launches(heads, target, knobs, meta(rows), stats)
        return launches[0 if kernel == "distill_tiled_stats" else 1]
    deterministic = kernel != "distill_tiled_grad"
    launches = L.tiled_grad_launches(heads, target, knobs, stats, grad_factor, meta(rows, HIDDEN),
                                     meta(vocab, HIDDEN), meta(vocab) if variant.bias else None, deterministic)
    return launches[1 if kernel == "distill_tiled_grad_weight" else 0]
