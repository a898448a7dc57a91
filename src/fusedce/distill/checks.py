"""Tensor checks of the distillation losses (``distill/distillation.py``; the scalar options: ``core/options/distill.py``);
every check runs before any kernel."""
from __future__ import annotations

import torch

from fusedce import backends
from fusedce.core import validation as val


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
