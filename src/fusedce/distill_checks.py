"""Argument checks of the distillation losses (``distillation.py``); every check runs before any kernel."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import backends
from . import validation as val
from .options import REDUCTIONS
from .options.checks import FP32_NORMAL, fp32_range, integer_option, real_option


@dataclasses.dataclass(frozen=True)
class DistillOptions:
    """The checked scalar options, passed to the backends' row ops as keywords (``kwargs()``)."""

    beta: float
    temperature: float
    hard_label_weight: float
    ignore_index: int
    student_softcap: Optional[float]
    teacher_softcap: Optional[float]

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


def _softcap(name: str, value) -> Optional[float]:
    if value is None:
        return None
    value = real_option(name, value)
    if not value > 0.0:
        raise ValueError(f"{name} must be None or a number > 0, got {value}")
    return fp32_range(name, value, FP32_NORMAL[0])


def options(beta, temperature, hard_label_weight, ignore_index, reduction, student_softcap, teacher_softcap,
            target) -> DistillOptions:
    """``ValueError`` for ``beta`` outside [0, 1], a ``temperature`` that is not a finite number > 0 (or
    whose inverse is not a normal fp32 number), a non-finite ``hard_label_weight`` or one != 0 without a
    target, a softcap <= 0, an unknown ``reduction``; ``TypeError`` for a value of the wrong kind."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    beta = real_option("beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1] (0: forward KL(teacher || student), 1: reverse KL), got {beta}")
    temperature = real_option("temperature", temperature)
    if not temperature > 0.0 or not FP32_NORMAL[0] <= 1.0 / temperature <= FP32_NORMAL[1]:
        raise ValueError(f"temperature must be a finite number > 0 whose inverse is a normal fp32 number, "
                         f"got {temperature}")
    hard_label_weight = real_option("hard_label_weight", hard_label_weight)
    if hard_label_weight != 0.0 and target is None:
        raise ValueError(f"hard_label_weight = {hard_label_weight} needs a target (the hard labels); got target=None")
    return DistillOptions(beta, temperature, fp32_range("hard_label_weight", hard_label_weight),
                          integer_option("ignore_index", ignore_index), _softcap("student_softcap", student_softcap),
                          _softcap("teacher_softcap", teacher_softcap))


def check_pair(student: torch.Tensor, teacher: torch.Tensor, s_name: str, t_name: str) -> None:
    """The two models' tensors of the same tokens: leading shapes equal, one device (``ValueError``)."""
    if tuple(student.shape[:-1]) != tuple(teacher.shape[:-1]):
        raise ValueError(f"{s_name} {tuple(student.shape)} and {t_name} {tuple(teacher.shape)} must cover the "
                         f"same tokens: their leading shapes (all but the last dimension) differ")
    if student.device != teacher.device:
        raise ValueError(f"{t_name} is on {teacher.device} but {s_name} is on {student.device}")


def check_head(hidden, weight, bias, model: str) -> None:
    """One model's ``hidden`` (..., H), ``weight`` (V, H), ``bias`` (V,) or None: float tensors of one dtype
    (``TypeError``) on one device, H > 0, V > 0 (``ValueError``)."""
    h_name, w_name, b_name = f"{model}_hidden", f"{model}_weight", f"{model}_bias"
    val.check_float(h_name, hidden)
    val.check_float(w_name, weight)
    if hidden.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"{h_name} must be (..., H) and {w_name} (V, H); got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    val.check_nonzero(h_name, hidden.shape, -1, "H")
    val.check_nonzero(w_name, weight.shape, 0, "V")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{h_name}.shape[-1] = {hidden.shape[-1]} must equal {w_name}.shape[1] = {weight.shape[1]}")
    if weight.device != hidden.device:
        raise ValueError(f"{w_name} is on {weight.device} but {h_name} is on {hidden.device}")
    val.check_vector(b_name, bias, weight.shape[0], hidden.device)
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(f"{h_name}, {w_name} and {b_name} must share a dtype; got {hidden.dtype}, {weight.dtype}"
                        f"{'' if bias is None else ', ' + str(bias.dtype)}")


def check_vocab(student_v: int, teacher_v: int, what: str) -> None:
    if student_v != teacher_v:
        raise ValueError(f"the student's and the teacher's heads must have the same vocabulary size V: {what} "
                         f"gives V = {student_v} for the student and {teacher_v} for the teacher")


def check_target(target, shape, device: torch.device, n_classes: int, ignore_index: int):
    """None, or an int64 / int32 tensor of ``shape`` on ``device`` (``TypeError`` / ``ValueError``), whose
    non-ignored values lie in [0, V) (``IndexError``; the one host sync, skipped under torch.compile /
    CUDA-graph capture). Returns the flat int64-safe target or None."""
    if target is None:
        return None
    val.check_target(target, shape, device)
    target = val.widen_target(target, ignore_index)
    val.check_target_range(target, n_classes, ignore_index)
    return target.reshape(-1)


def row_ops(backend, device: torch.device):
    """``(distill_rows, tiled_distill)`` of the chosen backend: whatever ``backends.get`` raises, a
    ``RuntimeError`` for a backend without distillation kernels (``"cute"``, ``Capabilities.distill``)."""
    impl = backends.get(backend, device, distill=True)
    return impl.distill_rows, impl.tiled_distill
