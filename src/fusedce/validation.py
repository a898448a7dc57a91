"""Argument checks of the public contract. Every check runs before any kernel writes anything."""
from __future__ import annotations

import math
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
        if not (softcap > 0.0 and math.isfinite(softcap)):
            raise ValueError(f"softcap must be a finite number > 0 (or None), got {softcap}")
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


def check_linear(hidden, weight, target, bias, ce_weight, chunk_size,
                 names=("weight", "bias", "ce_weight")) -> None:
    """Checks of ``linear_cross_entropy`` (and its vocab-parallel form, whose tensors are ``names``):
    float tensors, ``weight`` (V, H) with ``hidden`` (..., H) on one device, ``target`` (...), ``bias``
    and class weights (V,), one dtype for hidden/weight/bias, a positive ``chunk_size`` or None."""
    w_name, b_name, cw_name = names
    check_float("hidden", hidden)
    check_float(w_name, weight)
    if hidden.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"hidden must be (..., H) and {w_name} (V, H); got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden.shape[-1] = {hidden.shape[-1]} must equal {w_name}.shape[1] = "
                         f"{weight.shape[1]}")
    if weight.device != hidden.device:
        raise ValueError(f"{w_name} is on {weight.device} but hidden is on {hidden.device}")
    check_target(target, hidden.shape[:-1], hidden.device)
    check_vector(b_name, bias, weight.shape[0], hidden.device)
    check_vector(cw_name, ce_weight, weight.shape[0], hidden.device)
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(f"hidden, {w_name} and {b_name} must share a dtype; got {hidden.dtype}, "
                        f"{weight.dtype}{'' if bias is None else ', ' + str(bias.dtype)}")
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size}")


def check_num_items(num_items_in_batch, device: torch.device) -> None:
    """``num_items_in_batch``: None, a number, or a one-element tensor on ``device`` or the CPU."""
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must be a number or a one-element tensor, got shape "
                             f"{tuple(num_items_in_batch.shape)}")
        if num_items_in_batch.device not in (device, torch.device("cpu")):
            raise ValueError(f"num_items_in_batch is on {num_items_in_batch.device} but the data is on {device}")
