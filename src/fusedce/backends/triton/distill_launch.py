"""Launch builders of the distillation kernels, ``(kernel, grid, args, meta)``, in one place (also for
``fusedce inspect``)."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch
import triton

from fusedce.core.options.distill import DistillOptions
from . import tuning
from .kernels.distill_rows import distill_rows_kernel
from .kernels.distill_tiled_grad import (distill_tiled_grad_hidden_kernel, distill_tiled_grad_kernel,
                                         distill_tiled_grad_weight_kernel)
from .kernels.distill_tiled_stats import distill_tiled_jsd_kernel, distill_tiled_stats_kernel
from .launch import INTERPRETED, _align

Opt = Optional[torch.Tensor]


@dataclasses.dataclass(frozen=True)
class DistillKnobs(DistillOptions):
    """The distillation options as the kernels take them: ``DistillOptions``' fields, then ``has_target``."""

    has_target: bool

    @property
    def mode(self) -> int:
        """0: forward KL (beta = 0), 1: reverse KL (beta = 1), 2: generalized JSD (two passes for the loss)."""
        return 0 if self.beta == 0.0 else 1 if self.beta == 1.0 else 2

    def scalars(self) -> tuple:
        """The kernels' runtime arguments ``(beta, inv_t, hard_w, s_cap, t_cap, ignore_index)``."""
        return (float(self.beta), 1.0 / float(self.temperature), float(self.hard_label_weight),
                float(self.student_softcap or 1.0), float(self.teacher_softcap or 1.0), int(self.ignore_index))

    def flags(self) -> dict:
        """The constexpr code paths: a hard label only with a target and a weight; its own lse only when T != 1."""
        hard = self.has_target and self.hard_label_weight != 0.0
        return dict(MODE=self.mode, HAS_TARGET=self.has_target, HAS_HARD=hard,
                    HARD_OWN_LSE=hard and self.temperature != 1.0,
                    HAS_S_CAP=self.student_softcap is not None, HAS_T_CAP=self.teacher_softcap is not None)


def rows_launch(student, teacher, target: Opt, grad_factor: Opt, knobs: DistillKnobs, loss, grad: Opt):
    """``(kernel, grid, args, meta)`` of ``distill_rows_kernel`` (``grad`` in the student's dtype, with
    ``grad_factor``)."""
    n_rows, n_cols = student.shape
    cfg = tuning.distill_rows_config(n_cols)
    dummy = loss
    args = (student, teacher, dummy if target is None else target, dummy if grad_factor is None else grad_factor,
            loss, dummy if grad is None else grad, n_rows, n_cols, student.stride(0), teacher.stride(0),
            0 if target is None else target.stride(0), 0 if grad_factor is None else grad_factor.stride(0),
            0 if grad is None else grad.stride(0), *knobs.scalars())
    elem = min(student.element_size(), teacher.element_size(), 4 if grad is None else grad.element_size())
    align = _align(elem, n_cols, student.stride(0), teacher.stride(0), 0 if grad is None else grad.stride(0))
    meta = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_V=cfg["BLOCK_V"], ALIGN=align, HAS_GRAD=grad is not None,
                num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"], **knobs.flags())
    if INTERPRETED and grad is not None and grad.dtype == torch.bfloat16:
        meta["ROUND_BF16"] = True
    return distill_rows_kernel, (triton.cdiv(n_rows, cfg["BLOCK_N"]),), args, meta


def _dot_meta(prefix: str, dtype: torch.dtype) -> dict:
    """``<prefix>_DOT_PRECISION`` / ``_UPCAST`` / ``_ROUND_BF16`` of one head (``tiled._dot_meta``'s rule)."""
    precision = "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    meta = {f"{prefix}_DOT_PRECISION": precision}
    if INTERPRETED:
        meta.update({f"{prefix}_DOT_PRECISION": "ieee", f"{prefix}_UPCAST": dtype != torch.float32,
                     f"{prefix}_ROUND_BF16": dtype == torch.bfloat16})
    return meta


class Heads(NamedTuple):
    """The two heads of a tiled launch (hidden, weight, bias or None each), last dims contiguous."""

    s_hidden: torch.Tensor
    s_weight: torch.Tensor
    s_bias: Opt
    t_hidden: torch.Tensor
    t_weight: torch.Tensor
    t_bias: Opt

    def pointers(self) -> tuple:
        s_bias = self.s_weight if self.s_bias is None else self.s_bias   # a dummy pointer when absent
        t_bias = self.t_weight if self.t_bias is None else self.t_bias
        return (self.s_hidden, self.s_weight, s_bias, self.t_hidden, self.t_weight, t_bias)

    def sizes(self) -> tuple:
        """``n_rows, n_cols, s_n_hidden, t_n_hidden`` and the four operand strides."""
        return (self.s_hidden.shape[0], self.s_weight.shape[0], self.s_hidden.shape[1], self.t_hidden.shape[1],
                self.s_hidden.stride(0), self.s_weight.stride(0), self.t_hidden.stride(0), self.t_weight.stride(0))


def _tiled_meta(kernel: str, heads: Heads, knobs: DistillKnobs) -> tuple:
    elem = max(heads.s_hidden.element_size(), heads.t_hidden.element_size())
    cfg = tuning.distill_tiled_config(kernel, elem)
    meta = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_V=cfg["BLOCK_V"], BLOCK_H=cfg["BLOCK_H"], num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"], HAS_S_BIAS=heads.s_bias is not None,
                HAS_T_BIAS=heads.t_bias is not None, **knobs.flags(),
                **_dot_meta("S", heads.s_hidden.dtype), **_dot_meta("T", heads.t_hidden.dtype))
    return cfg, meta


def _rows_args(target: Opt, heads: Heads, knobs: DistillKnobs) -> tuple:
    return (heads.sizes() + (0 if target is None else target.stride(0),), knobs.scalars())


def tiled_stats_launches(heads: Heads, target: Opt, knobs: DistillKnobs, loss, stats) -> list:
    """The statistics launches: pass 1, and for 0 < beta < 1 the JSD pass."""
    sizes, scalars = _rows_args(target, heads, knobs)
    ptrs = heads.pointers() + (loss if target is None else target, loss, stats)
    cfg, meta = _tiled_meta("distill_tiled_stats", heads, knobs)
    grid = (triton.cdiv(heads.s_hidden.shape[0], cfg["BLOCK_N"]),)
    launches = [(distill_tiled_stats_kernel, grid, ptrs + sizes + scalars, meta)]
    if knobs.mode == 2:
        cfg, meta = _tiled_meta("distill_tiled_jsd", heads, knobs)
        for key in ("MODE", "HAS_HARD", "HARD_OWN_LSE"):
            del meta[key]
        launches.append((distill_tiled_jsd_kernel, (triton.cdiv(heads.s_hidden.shape[0], cfg["BLOCK_N"]),),
                         ptrs + sizes + scalars, meta))
    return launches


def tiled_grad_launches(heads: Heads, target: Opt, knobs: DistillKnobs, stats, grad_factor,
                        grad_hidden: Opt, grad_weight: Opt, grad_bias: Opt, deterministic: bool) -> list:
    """The gradient launches: atomic, or (``deterministic``) the grad_hidden and / or grad_weight owners."""
    sizes, scalars = _rows_args(target, heads, knobs)
    sizes = sizes + (grad_factor.stride(0),)
    inputs = heads.pointers() + (stats if target is None else target, stats, grad_factor)
    n_rows, n_cols = heads.s_hidden.shape[0], heads.s_weight.shape[0]
    if not deterministic:
        cfg, meta = _tiled_meta("distill_tiled_grad", heads, knobs)
        meta.update(NEED_GRAD_HIDDEN=grad_hidden is not None, NEED_GRAD_WEIGHT=grad_weight is not None,
                    NEED_GRAD_BIAS=grad_bias is not None)
        outs = tuple(stats if t is None else t for t in (grad_hidden, grad_weight, grad_bias))
        grid = (triton.cdiv(n_rows, cfg["BLOCK_N"]), triton.cdiv(n_cols, cfg["BLOCK_V"]))
        return [(distill_tiled_grad_kernel, grid, inputs + outs + sizes + scalars, meta)]
    launches = []
    if grad_hidden is not None:
        cfg, meta = _tiled_meta("distill_tiled_grad_hidden", heads, knobs)
        launches.append((distill_tiled_grad_hidden_kernel, (triton.cdiv(n_rows, cfg["BLOCK_N"]),),
                         inputs + (grad_hidden,) + sizes + scalars, meta))
    if grad_weight is not None or grad_bias is not None:
        cfg, meta = _tiled_meta("distill_tiled_grad_weight", heads, knobs)
        meta.update(NEED_GRAD_WEIGHT=grad_weight is not None, NEED_GRAD_BIAS=grad_bias is not None)
        outs = tuple(stats if t is None else t for t in (grad_weight, grad_bias))
        launches.append((distill_tiled_grad_weight_kernel, (triton.cdiv(n_cols, cfg["BLOCK_V"]),),
                         inputs + outs + sizes + scalars, meta))
    return launches
