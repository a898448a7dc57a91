"""Distillation of two linear heads on Triton with no logits of either model (``method="tiled"``): the backend op
``tiled_distill`` as the torch custom op ``fusedce::tiled_distill`` with a fake, so that ``torch.compile`` traces
it."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..layout import opt_contiguous, unit_stride
from .distill import _check_options, _check_rows, _knobs, _new_rows
from .distill_launch import Heads, tiled_grad_launches, tiled_stats_launches
from .tiled import run_launches

Opt = Optional[torch.Tensor]


@torch.library.custom_op("fusedce::tiled_distill", mutates_args=())
def tiled_distill_op(student_hidden: torch.Tensor, student_weight: torch.Tensor, student_bias: Opt,
                     teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, teacher_bias: Opt,
                     target: Opt, grad_factor: Opt, beta: float, temperature: float, hard_label_weight: float,
                     ignore_index: int, student_softcap: Optional[float], teacher_softcap: Optional[float],
                     deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss_rows, grad_hidden, grad_weight, grad_bias)``; a gradient not computed is (0,)."""
    n, n_cols = student_hidden.shape[0], student_weight.shape[0]
    with_grad = grad_factor is not None
    loss = _new_rows(student_hidden, n)
    sh, sw, sb = _tiled_grad_shapes(student_hidden, student_weight, student_bias, with_grad)
    acc_h = student_hidden.new_zeros(sh, dtype=torch.float32)
    acc_w = student_hidden.new_zeros(sw, dtype=torch.float32)
    acc_b = student_hidden.new_zeros(sb, dtype=torch.float32)
    if n and n_cols:
        knobs = _knobs(target, beta, temperature, hard_label_weight, ignore_index, student_softcap, teacher_softcap)
        heads = Heads(unit_stride(student_hidden), unit_stride(student_weight),
                      opt_contiguous(student_bias), unit_stride(teacher_hidden),
                      unit_stride(teacher_weight), opt_contiguous(teacher_bias))
        stats = _new_rows(student_hidden, (4, n))
        run_launches(tiled_stats_launches(heads, target, knobs, loss, stats))
        if with_grad:
            run_launches(tiled_grad_launches(heads, target, knobs, stats, grad_factor, acc_h, acc_w,
                                             acc_b if student_bias is not None else None, bool(deterministic)))
    else:
        loss.zero_()
    return loss, acc_h.to(student_hidden.dtype), acc_w, acc_b


def _tiled_grad_shapes(student_hidden, student_weight, student_bias, with_grad: bool):
    if not with_grad:
        return (0,), (0,), (0,)
    return (tuple(student_hidden.shape), tuple(student_weight.shape),
            (student_weight.shape[0],) if student_bias is not None else (0,))


@tiled_distill_op.register_fake
def _(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target,
      grad_factor, beta, temperature, hard_label_weight, ignore_index, student_softcap, teacher_softcap,
      deterministic):
    sh, sw, sb = _tiled_grad_shapes(student_hidden, student_weight, student_bias, grad_factor is not None)
    return (student_hidden.new_empty(student_hidden.shape[0], dtype=torch.float32), student_hidden.new_empty(sh),
            student_hidden.new_empty(sw, dtype=torch.float32), student_hidden.new_empty(sb, dtype=torch.float32))


def tiled_distill(student_hidden: torch.Tensor, student_weight: torch.Tensor, student_bias: Opt,
                  teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, teacher_bias: Opt,
                  target: Opt, grad_factor: Opt, *, beta: float, temperature: float, hard_label_weight: float,
                  ignore_index: int, student_softcap: Optional[float], teacher_softcap: Optional[float],
                  deterministic: bool, batch_invariant: bool = False) -> Tuple[torch.Tensor, Opt, Opt, Opt]:
    """Per-row distillation loss of two linear heads and the student head's gradients, no logits of either
    model in memory (tiles formed on chip: ``kernels/distill_tiled_*.py``). Shapes as
    ``backends/pytorch/distill_tiled.tiled_distill``; ``deterministic`` (or ``batch_invariant``): the gradient
    pass without atomics. Returns ``(loss_rows (N,) fp32, grad_hidden, grad_weight, grad_bias)`` (fp32 weight /
    bias gradients, times ``grad_factor`` per row; None without it); ``ValueError`` for mismatched shapes."""
    n, hs = student_hidden.shape if student_hidden.dim() == 2 else (None, None)
    if (student_hidden.dim() != 2 or student_weight.dim() != 2 or student_weight.shape[1] != hs
            or teacher_hidden.dim() != 2 or teacher_weight.dim() != 2 or teacher_hidden.shape[0] != n
            or teacher_weight.shape != (student_weight.shape[0], teacher_hidden.shape[1])):
        raise ValueError(f"expected student (N, H) x (V, H) and teacher (N, Ht) x (V, Ht), got "
                         f"{tuple(student_hidden.shape)} x {tuple(student_weight.shape)} and "
                         f"{tuple(teacher_hidden.shape)} x {tuple(teacher_weight.shape)}")
    for name, h, w, b in (("student", student_hidden, student_weight, student_bias),
                          ("teacher", teacher_hidden, teacher_weight, teacher_bias)):
        if w.dtype != h.dtype or (b is not None and (b.dtype != h.dtype or b.shape != (w.shape[0],))):
            raise ValueError(f"the {name}'s weight (and bias, shape (V,)) must have its hidden states' dtype "
                             f"{h.dtype}")
    _check_rows(n, target, grad_factor)
    _check_options(beta, temperature, hard_label_weight, target, student_softcap, teacher_softcap)
    loss, gh, gw, gb = torch.ops.fusedce.tiled_distill(
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target,
        grad_factor, float(beta), float(temperature), float(hard_label_weight), int(ignore_index),
        student_softcap, teacher_softcap, bool(deterministic or batch_invariant))
    if grad_factor is None:
        return loss, None, None, None
    return loss, gh, gw, (gb if student_bias is not None else None)


# ``Backend.tiled_distill.invariant_rows``: 64, as ``TritonTiledCE.invariant_rows`` (tiles fixed per kernel and
# dtype, ``tuning.distill_tiled_config``; a partial token tile's rows masked; with ``deterministic`` no atomics)
tiled_distill.invariant_rows = lambda n_classes: 64
