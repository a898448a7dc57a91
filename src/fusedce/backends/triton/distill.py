"""Distillation on Triton: the backend row op ``distill_rows`` (logits in memory) as a torch custom op with a fake so
that ``torch.compile`` traces it, and the checks it shares with ``tiled_distill`` (no logits of either model,
``distill_tiled.py``)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..layout import unit_stride
from .distill_launch import DistillKnobs, rows_launch
from .tiled import run_launches

Opt = Optional[torch.Tensor]


def _check_options(beta, temperature, hard_label_weight, target, student_softcap, teacher_softcap) -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hard_label_weight != 0.0 and target is None:
        raise ValueError("hard_label_weight != 0 needs a target")
    for name, cap in (("student_softcap", student_softcap), ("teacher_softcap", teacher_softcap)):
        if cap is not None and not cap > 0.0:
            raise ValueError(f"{name} must be > 0 or None, got {cap}")


def _check_rows(n: int, target: Opt, grad_factor: Opt) -> None:
    if target is not None and (target.shape != (n,) or target.is_floating_point()):
        raise ValueError(f"target must be an integer tensor of shape ({n},), got {tuple(target.shape)} "
                         f"{target.dtype}")
    if grad_factor is not None and (grad_factor.shape != (n,) or not grad_factor.is_floating_point()):
        raise ValueError(f"grad_factor must be a float tensor of shape ({n},), got {tuple(grad_factor.shape)} "
                         f"{grad_factor.dtype}")


def _knobs(target, beta, temperature, hard_label_weight, ignore_index, student_softcap, teacher_softcap):
    return DistillKnobs(float(beta), float(temperature), float(hard_label_weight), int(ignore_index),
                        None if student_softcap is None else float(student_softcap),
                        None if teacher_softcap is None else float(teacher_softcap), target is not None)


@torch.library.custom_op("fusedce::distill_rows", mutates_args=())
def distill_rows_op(student_logits: torch.Tensor, teacher_logits: torch.Tensor, target: Opt, grad_factor: Opt,
                    beta: float, temperature: float, hard_label_weight: float, ignore_index: int,
                    student_softcap: Optional[float], teacher_softcap: Optional[float]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_rows (n,) fp32, grad (n, V) student's dtype, or (0,) without grad_factor)``."""
    loss, grad = _rows_buffers(student_logits, grad_factor is not None)
    if student_logits.shape[0] and student_logits.shape[1]:
        knobs = _knobs(target, beta, temperature, hard_label_weight, ignore_index, student_softcap, teacher_softcap)
        run_launches([rows_launch(unit_stride(student_logits), unit_stride(teacher_logits), target, grad_factor,
                                  knobs, loss, grad if grad_factor is not None else None)])
    else:   # no rows or no classes: nothing to launch
        loss.zero_()
        grad.zero_()
    return loss, grad


def _new_rows(like: torch.Tensor, shape) -> torch.Tensor:
    """An uninitialized fp32 buffer that the kernels write whole (tests poison it through this function)."""
    return like.new_empty(shape, dtype=torch.float32)


def _rows_buffers(student_logits: torch.Tensor, with_grad: bool):
    n = student_logits.shape[0]
    grad = (student_logits.new_empty(student_logits.shape) if with_grad
            else student_logits.new_empty(0))
    return _new_rows(student_logits, n), grad


@distill_rows_op.register_fake
def _(student_logits, teacher_logits, target, grad_factor, beta, temperature, hard_label_weight, ignore_index,
      student_softcap, teacher_softcap):
    return _rows_buffers(student_logits, grad_factor is not None)


def distill_rows(student_logits: torch.Tensor, teacher_logits: torch.Tensor, target: Opt, grad_factor: Opt, *,
                 beta: float, temperature: float, hard_label_weight: float, ignore_index: int,
                 student_softcap: Optional[float], teacher_softcap: Optional[float]
                 ) -> Tuple[torch.Tensor, Opt]:
    """Per-row distillation loss and its student-logit gradient (formulas: ``kernels/distill_math.py``): logits
    (N, V) of any float dtypes, ``target`` (N,) int64 or None, ``grad_factor`` (N,) or None, the options as
    ``fusedce.distillation_loss``. Returns ``(loss_rows (N,) fp32, grad (N, V) in the student's dtype or
    None)``; ``ValueError`` for mismatched shapes or options out of range. The inputs are never written."""
    if student_logits.dim() != 2 or teacher_logits.shape != student_logits.shape:
        raise ValueError(f"student and teacher logits must both be (N, V), got {tuple(student_logits.shape)} "
                         f"and {tuple(teacher_logits.shape)}")
    _check_rows(student_logits.shape[0], target, grad_factor)
    _check_options(beta, temperature, hard_label_weight, target, student_softcap, teacher_softcap)
    loss, grad = torch.ops.fusedce.distill_rows(student_logits, teacher_logits, target, grad_factor, float(beta),
                                                float(temperature), float(hard_label_weight), int(ignore_index),
                                                student_softcap, teacher_softcap)
    return loss, (grad if grad_factor is not None else None)
