"""Launchers: validate -> launch into caller-supplied buffers. No allocation of BT x V here, no sync."""
from __future__ import annotations

from typing import Optional

import torch
import triton

from ...types import LossOptions
from .kernels.ce_backward import ce_backward_kernel
from .kernels.ce_forward import ce_forward_kernel
from .tuning import backward_config, forward_config


def _flags(weight, opts: LossOptions) -> dict:
    return {"HAS_WEIGHT": weight is not None, "HAS_SMOOTHING": opts.label_smoothing > 0.0,
            "HAS_SOFTCAP": opts.softcap is not None}


def _scalars(opts: LossOptions) -> tuple:
    return (opts.ignore_index, opts.label_smoothing, opts.lse_square_scale,
            1.0 if opts.softcap is None else opts.softcap)


def ce_forward(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
               weight_sum: Optional[torch.Tensor], opts: LossOptions, loss: torch.Tensor,
               lse: torch.Tensor, predicted: Optional[torch.Tensor]) -> None:
    """Fill ``loss``/``lse`` (and ``predicted`` when given) for ``logits`` ((BT, V), last dim stride 1).

    ``loss``, ``lse``: (BT,) fp32 contiguous; ``predicted``: (BT,) int64 or None (no argmax computed).
    ``weight_sum``: 1-element fp32 tensor = weight.sum() when ``weight`` is given.
    """
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    dummy = loss  # any valid pointer for arguments a constexpr flag leaves unread
    cfg = forward_config(n_cols)
    ce_forward_kernel[(n_rows,)](
        logits, target, dummy if weight is None else weight,
        dummy if weight_sum is None else weight_sum,
        loss, lse, dummy if predicted is None else predicted,
        n_cols, logits.stride(0), target.stride(0), *_scalars(opts),
        BLOCK_V=cfg["BLOCK_V"], COMPUTE_STATS=predicted is not None, **_flags(weight, opts),
        num_warps=cfg["num_warps"])


def ce_backward(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                weight_sum: Optional[torch.Tensor], lse: torch.Tensor, grad_row: torch.Tensor,
                opts: LossOptions, grad: torch.Tensor) -> None:
    """Write d(sum_i grad_row[i] * loss_i)/d logits into ``grad`` ((BT, V), may be ``logits`` itself).

    ``grad_row``: (BT,) any float dtype and any stride (an expanded stride-0 scalar is fine).
    """
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    dummy = lse
    cfg = backward_config(n_cols)
    grid = (n_rows, triton.cdiv(n_cols, cfg["BLOCK_V"]))
    ce_backward_kernel[grid](
        logits, grad, target, dummy if weight is None else weight,
        dummy if weight_sum is None else weight_sum, lse, grad_row,
        n_cols, logits.stride(0), grad.stride(0), target.stride(0), grad_row.stride(0),
        *_scalars(opts), BLOCK_V=cfg["BLOCK_V"], **_flags(weight, opts), num_warps=cfg["num_warps"])
