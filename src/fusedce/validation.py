"""Argument checks of the public contract. Every check runs before any kernel writes anything."""
from __future__ import annotations

from typing import Optional

import torch

from .types import LossOptions

REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)


def loss_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap) -> LossOptions:
    """Check the scalar options; raise ``ValueError`` on a bad reduction, smoothing or softcap."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    label_smoothing = float(label_smoothing)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None:
        softcap = float(softcap)
        if not softcap > 0.0:
            raise ValueError(f"softcap must be > 0 (or None), got {softcap}")
    return LossOptions(int(ignore_index), label_smoothing, float(lse_square_scale), softcap)


def check_target(target: torch.Tensor, expected_shape, device: torch.device) -> None:
    """``target`` must be an int32/int64 tensor of ``expected_shape`` on ``device``."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a tensor, got {type(target).__name__}")
    if target.dtype not in INDEX_DTYPES:
        raise TypeError(f"target must be int64 or int32, got {target.dtype}")
    if tuple(target.shape) != tuple(expected_shape):
        raise ValueError(f"target shape {tuple(target.shape)} must equal {tuple(expected_shape)}")
    if target.device != device:
        raise ValueError(f"target is on {target.device} but the data is on {device}")


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def check_vector(name: str, t: Optional[torch.Tensor], size: int, device: torch.device) -> None:
    """An optional ``(size,)`` float tensor on ``device`` (class weights, bias)."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor")
    if t.dim() != 1 or t.shape[0] != size:
        raise ValueError(f"{name} must have shape ({size},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the data is on {device}")


def sync_allowed() -> bool:
    """The target-range check host-syncs; skip it under torch.compile and CUDA-graph capture."""
    if torch.compiler.is_compiling():
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return True


def check_target_range(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Raise ``IndexError`` naming the first target that is neither ``ignore_index`` nor in ``[0, V)``.

    This is the contract's one documented host sync of ``cross_entropy``; skipped (a bad row then
    gives a NaN loss row, never an out-of-bounds read) while compiling or capturing a CUDA graph.
    """
    if target.numel() == 0 or not sync_allowed():
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
    if bool(bad.any()):
        flat = bad.reshape(-1).nonzero()[0, 0]
        pos = tuple(int(i) for i in torch.unravel_index(flat, tuple(target.shape)))
        value = int(target.reshape(-1)[flat])
        raise IndexError(
            f"target{list(pos)} = {value} is out of range: expected ignore_index={ignore_index} "
            f"or a class in [0, {n_classes}) (V = {n_classes})"
        )
