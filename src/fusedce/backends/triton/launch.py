"""Launchers: validate -> launch into caller-supplied buffers. No allocation of BT x V here, no sync."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton

from fusedce.core.options import LossOptions
from .kernels.ce_backward import ce_backward_kernel
from .kernels.ce_chunk import ce_chunk_kernel
from .kernels.ce_slice import ce_slice_stats_kernel
from .kernels.ce_forward import ce_forward_kernel
from .tuning import backward_config, forward_config

# Under TRITON_INTERPRET=1 (CPU tests) @triton.jit gives interpreted functions, whose fp32 -> bf16 cast
# truncates; the backward then rounds by hand so that tests see what a GPU writes.
INTERPRETED = not isinstance(ce_backward_kernel, triton.runtime.jit.JITFunction)


def _align(elem_size: int, *ints: int) -> int:
    """The kernels' ``ALIGN``: the largest power of two, at most one 16-byte vector, dividing every int given."""
    align = 16 // elem_size
    while align > 1 and any(v % align for v in ints):
        align //= 2
    return align


def forward_launch(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                   weight_sum: Optional[torch.Tensor], opts: LossOptions, loss: torch.Tensor,
                   lse: torch.Tensor, lse_lo: torch.Tensor, predicted: Optional[torch.Tensor],
                   entropy: Optional[torch.Tensor] = None):
    """``(kernel, grid, args, meta)`` of the forward launch (``ce_forward``); ``entropy`` None: not computed."""
    n_rows, n_cols = logits.shape
    dummy = loss  # any valid pointer for arguments a constexpr flag leaves unread
    cfg = forward_config(n_cols)
    args = (logits, target, dummy if weight is None else weight, dummy if weight_sum is None else weight_sum,
            loss, lse, lse_lo, dummy if predicted is None else predicted, dummy if entropy is None else entropy,
            n_cols, logits.stride(0), target.stride(0), opts.kernel_scalars())
    meta = dict(BLOCK_V=cfg["BLOCK_V"], ALIGN=_align(logits.element_size(), n_cols, logits.stride(0)),
                FLAGS=opts.kernel_flags(weight is not None), COMPUTE_STATS=predicted is not None,
                num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"])
    if entropy is not None:
        meta["COMPUTE_ENTROPY"] = True
    return ce_forward_kernel, (n_rows,), args, meta


def backward_launch(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                    weight_sum: Optional[torch.Tensor], lse: torch.Tensor, lse_lo: torch.Tensor,
                    grad_row: torch.Tensor, grad_lse: Optional[torch.Tensor], opts: LossOptions,
                    grad: torch.Tensor, vocab: Optional["VocabSlice"] = None,
                    grad_entropy: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None):
    """``(kernel, grid, args, meta)`` of the backward launch (``ce_backward``); ``vocab``: a slice (None: all);
    ``grad_entropy`` with the forward's ``entropy``: the entropy's term."""
    n_rows, n_cols = logits.shape
    vocab = VocabSlice(0, n_cols) if vocab is None else vocab
    dummy = lse
    cfg = backward_config(n_cols)
    grid = (n_rows, triton.cdiv(n_cols, cfg["BLOCK_V"]))
    has_grad_lse = grad_lse is not None
    grad_lse = grad_row if grad_lse is None else grad_lse
    args = (logits, grad, target, dummy if weight is None else weight,
            dummy if weight_sum is None else weight_sum, lse, lse_lo, grad_row, grad_lse,
            dummy if vocab.target_weight is None else vocab.target_weight,
            dummy if grad_entropy is None else grad_entropy, dummy if grad_entropy is None else entropy,
            n_cols, vocab.col_start, vocab.n_total,
            logits.stride(0), grad.stride(0), target.stride(0), grad_row.stride(0), grad_lse.stride(0),
            0 if grad_entropy is None else grad_entropy.stride(0), opts.kernel_scalars())
    align = _align(min(logits.element_size(), grad.element_size()), n_cols, logits.stride(0), grad.stride(0))
    meta = dict(BLOCK_V=cfg["BLOCK_V"], ALIGN=align, FLAGS=opts.kernel_flags(weight is not None),
                HAS_GRAD_LSE=has_grad_lse, HAS_TARGET_WEIGHT=vocab.target_weight is not None,
                num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"])
    if grad_entropy is not None:
        meta["HAS_GRAD_ENTROPY"] = True
    if INTERPRETED and grad.dtype == torch.bfloat16:
        meta["ROUND_BF16"] = True
    return ce_backward_kernel, grid, args, meta


class VocabSlice(NamedTuple):
    """Columns ``[col_start, col_start + V_r)`` of ``n_total`` classes; ``target_weight``: each row's global w_t."""

    col_start: int
    n_total: int
    target_weight: Optional[torch.Tensor] = None


def slice_stats_launch(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                       opts: LossOptions, col_start: int, out: tuple):
    """``(kernel, grid, args, meta)`` of the slice-statistics launch (``ce_slice``) into the (n,) buffers ``out``."""
    n_rows, n_cols = logits.shape
    cfg = forward_config(n_cols)
    entropy = len(out) > 6
    args = (logits, target, out[0] if weight is None else weight, *out[:6], out[6] if entropy else out[0],
            n_cols, col_start, logits.stride(0), target.stride(0), opts.kernel_scalars())
    meta = dict(BLOCK_V=cfg["BLOCK_V"], ALIGN=_align(logits.element_size(), n_cols, logits.stride(0)),
                FLAGS=opts.kernel_flags(weight is not None), num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"])
    if entropy:
        meta["COMPUTE_ENTROPY"] = True
    return ce_slice_stats_kernel, (n_rows,), args, meta


def ce_slice_stats(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                   opts: LossOptions, col_start: int, out: tuple) -> None:
    """Fill ``out`` with the partial row statistics of a vocabulary slice (``kernels/ce_slice.py``)."""
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        return
    kernel, grid, args, meta = slice_stats_launch(logits, target, weight, opts, col_start, out)
    kernel[grid](*args, **meta)


def chunk_launch(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                 weight_sum: Optional[torch.Tensor], grad_row: torch.Tensor, z_grad_row: torch.Tensor,
                 opts: LossOptions, loss: torch.Tensor, lse: torch.Tensor, lse_lo: torch.Tensor,
                 predicted: Optional[torch.Tensor], token_weight: Optional[torch.Tensor]):
    """``(kernel, grid, args, meta)`` of the fused chunk launch (``ce_chunk``): one program per row."""
    n_rows, n_cols = logits.shape
    dummy = loss
    cfg = forward_config(n_cols)
    args = (logits, target, dummy if weight is None else weight, dummy if weight_sum is None else weight_sum,
            grad_row, z_grad_row, loss, lse, lse_lo, dummy if predicted is None else predicted,
            dummy if token_weight is None else token_weight,
            n_cols, logits.stride(0), target.stride(0), grad_row.stride(0), z_grad_row.stride(0),
            opts.kernel_scalars())
    meta = dict(BLOCK_V=cfg["BLOCK_V"], ALIGN=_align(logits.element_size(), n_cols, logits.stride(0)),
                FLAGS=opts.kernel_flags(weight is not None), COMPUTE_STATS=predicted is not None,
                HAS_ZLOSS=opts.lse_square_scale != 0.0, TOKEN_SCALING=opts.use_token_scaling,
                num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"])
    if INTERPRETED and logits.dtype == torch.bfloat16:
        meta["ROUND_BF16"] = True
    return ce_chunk_kernel, (n_rows,), args, meta


def ce_chunk_(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
              weight_sum: Optional[torch.Tensor], grad_row: torch.Tensor, z_grad_row: torch.Tensor,
              opts: LossOptions, loss: torch.Tensor, lse: torch.Tensor, lse_lo: torch.Tensor,
              predicted: Optional[torch.Tensor], token_weight: Optional[torch.Tensor]) -> None:
    """Fill ``loss``/``lse``/``lse_lo`` (and ``predicted``, ``token_weight``) for the chunk and overwrite ``logits``
    with its gradient (z-loss and token scaling applied)."""
    if logits.shape[0] == 0:
        return
    kernel, grid, args, meta = chunk_launch(logits, target, weight, weight_sum, grad_row, z_grad_row, opts,
                                            loss, lse, lse_lo, predicted, token_weight)
    kernel[grid](*args, **meta)


def ce_forward(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
               weight_sum: Optional[torch.Tensor], opts: LossOptions, loss: torch.Tensor,
               lse: torch.Tensor, lse_lo: torch.Tensor, predicted: Optional[torch.Tensor],
               entropy: Optional[torch.Tensor] = None) -> None:
    """Fill ``loss``/``lse``/``lse_lo`` (and ``predicted`` when given) for ``logits`` ((BT, V), last dim stride 1)."""
    if logits.shape[0] == 0:
        return
    kernel, grid, args, meta = forward_launch(logits, target, weight, weight_sum, opts, loss, lse, lse_lo,
                                              predicted, entropy)
    kernel[grid](*args, **meta)


def ce_backward(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                weight_sum: Optional[torch.Tensor], lse: torch.Tensor, lse_lo: torch.Tensor,
                grad_row: torch.Tensor, grad_lse: Optional[torch.Tensor], opts: LossOptions,
                grad: torch.Tensor, vocab: Optional["VocabSlice"] = None,
                grad_entropy: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None) -> None:
    """Write d(sum_i grad_row[i] loss_i + grad_lse[i] lse_i [+ grad_entropy[i] entropy_i])/d logits into ``grad``."""
    if logits.shape[0] == 0:
        return
    kernel, grid, args, meta = backward_launch(logits, target, weight, weight_sum, lse, lse_lo, grad_row,
                                               grad_lse, opts, grad, vocab, grad_entropy, entropy)
    kernel[grid](*args, **meta)
