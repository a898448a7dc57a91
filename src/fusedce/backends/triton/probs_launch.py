"""Launchers of the probability-target kernels (``kernels/probs_forward.py``, ``kernels/probs_backward.py``):
validate -> launch into caller-supplied buffers; no allocation, no sync."""
from __future__ import annotations

from typing import Optional

import torch
import triton

from fusedce.core.options import LossOptions
from .kernels.probs_backward import probs_backward_kernel
from .kernels.probs_forward import probs_forward_kernel
from .launch import INTERPRETED, _align
from .tuning import backward_config, forward_config


def probs_forward_launch(logits: torch.Tensor, q: torch.Tensor, weight: Optional[torch.Tensor], opts: LossOptions,
                        loss: torch.Tensor, lse: torch.Tensor, lse_lo: torch.Tensor, a: torch.Tensor,
                        predicted: Optional[torch.Tensor]):
    """``(kernel, grid, args, meta)`` of the forward: one program per row."""
    n_rows, n_cols = logits.shape
    cfg = forward_config(n_cols)
    args = (logits, q, loss if weight is None else weight, loss, lse, lse_lo, a,
            loss if predicted is None else predicted, n_cols, logits.stride(0), q.stride(0), opts.kernel_scalars())
    align = _align(min(logits.element_size(), q.element_size()), n_cols, logits.stride(0), q.stride(0))
    meta = dict(BLOCK_V=cfg["BLOCK_V"], ALIGN=align, FLAGS=opts.kernel_flags(weight is not None),
                COMPUTE_STATS=predicted is not None, num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"])
    return probs_forward_kernel, (n_rows,), args, meta


def probs_backward_launch(logits: torch.Tensor, q: torch.Tensor, weight: Optional[torch.Tensor], lse: torch.Tensor,
                         lse_lo: torch.Tensor, a: torch.Tensor, grad_row: torch.Tensor,
                         grad_lse: Optional[torch.Tensor], opts: LossOptions, grad: torch.Tensor):
    """``(kernel, grid, args, meta)`` of the backward: a (row, vocabulary block) grid."""
    n_rows, n_cols = logits.shape
    cfg = backward_config(n_cols)
    has_grad_lse = grad_lse is not None
    grad_lse = grad_row if grad_lse is None else grad_lse
    args = (logits, q, grad, lse if weight is None else weight, lse, lse_lo, a, grad_row, grad_lse, n_cols,
            logits.stride(0), q.stride(0), grad.stride(0), grad_row.stride(0), grad_lse.stride(0),
            opts.kernel_scalars())
    sizes = (logits.element_size(), q.element_size(), grad.element_size())
    align = _align(min(sizes), n_cols, logits.stride(0), q.stride(0), grad.stride(0))
    meta = dict(BLOCK_V=cfg["BLOCK_V"], ALIGN=align, FLAGS=opts.kernel_flags(weight is not None),
                HAS_GRAD_LSE=has_grad_lse, num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"])
    if INTERPRETED and grad.dtype == torch.bfloat16:
        meta["ROUND_BF16"] = True
    return probs_backward_kernel, (n_rows, triton.cdiv(n_cols, cfg["BLOCK_V"])), args, meta


def probs_forward(logits: torch.Tensor, q: torch.Tensor, weight: Optional[torch.Tensor], opts: LossOptions,
                 loss: torch.Tensor, lse: torch.Tensor, lse_lo: torch.Tensor, a: torch.Tensor,
                 predicted: Optional[torch.Tensor]) -> None:
    """Fill ``loss`` (cross-entropy without z-loss), ``lse``, ``lse_lo``, ``a`` ((BT,) fp32 contiguous)
    and ``predicted`` ((BT,) int64, or None: no argmax) for ``logits`` and targets ``q`` ((BT, V), last dim
    stride 1 each; ``weight`` (V,) contiguous or None)."""
    if logits.shape[0] == 0:
        return
    kernel, grid, args, meta = probs_forward_launch(logits, q, weight, opts, loss, lse, lse_lo, a, predicted)
    kernel[grid](*args, **meta)


def probs_backward(logits: torch.Tensor, q: torch.Tensor, weight: Optional[torch.Tensor], lse: torch.Tensor,
                  lse_lo: torch.Tensor, a: torch.Tensor, grad_row: torch.Tensor, grad_lse: Optional[torch.Tensor],
                  opts: LossOptions, grad: torch.Tensor) -> None:
    """Write d(sum_i grad_row[i] loss_i + grad_lse[i] lse_i)/d logits into ``grad`` ((BT, V), last dim
    stride 1, may be ``logits`` itself). ``grad_row`` / ``grad_lse`` (None: 0): (BT,) any float dtype and
    stride."""
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        return
    kernel, grid, args, meta = probs_backward_launch(logits, q, weight, lse, lse_lo, a, grad_row, grad_lse, opts,
                                                    grad)
    kernel[grid](*args, **meta)
