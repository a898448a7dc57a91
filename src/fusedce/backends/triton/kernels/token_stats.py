"""TRL's per-token statistics of a chunk of logits whose lse is known (``types.TokenStats``): one program per row, one
pass over it in BLOCK_V blocks (the same ``logit_transform`` as the loss)."""
import triton
import triton.language as tl

from .common import aligned, running_argmax
from .row_math import z_block


@triton.jit
def token_stats_kernel(
    # pointers
    logits_ptr,        # [n_rows, n_cols] fp32/bf16/fp16, last dim contiguous
    target_ptr,        # [n_rows] int32/int64
    lse_ptr,           # [n_rows] fp32: the forward's lse
    lse_lo_ptr,        # [n_rows] fp32: its rounding error
    log_sum_sq_ptr,    # [n_rows] fp32 out
    mean_ptr,          # [n_rows] fp32 out
    is_top1_ptr,       # [n_rows] uint8 out (0 / 1; the caller views it as bool)
    # sizes
    n_cols,
    # strides (elements)
    stride_logits_row, stride_target,
    # loss options (``options.LossScalars``; runtime)
    scalars,
    # meta-parameters
    BLOCK_V: tl.constexpr,
    ALIGN: tl.constexpr,  # n_cols and stride_logits_row are multiples of ALIGN (common.aligned)
    FLAGS: tl.constexpr,  # options.LossFlags
):
    n_cols = aligned(n_cols, ALIGN)
    stride_logits_row = aligned(stride_logits_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits_row
    target = tl.load(target_ptr + row * stride_target).to(tl.int64)
    is_valid = target != scalars.ignore_index
    lse = tl.load(lse_ptr + row)
    lse_lo = tl.load(lse_lo_ptr + row)
    sq = 0.0
    zsum = 0.0
    best = -float("inf")
    best_idx = 0
    for start in range(0, tl.where(is_valid, n_cols, 0), BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        _x, z = z_block(row_ptr, cols, mask, scalars, FLAGS)   # -inf on padded columns
        sq += tl.sum(tl.exp(2.0 * ((z - lse) - lse_lo)), axis=0)
        zsum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        best, best_idx = running_argmax(best, best_idx, z, start, 0)
    tl.store(log_sum_sq_ptr + row, tl.where(is_valid, tl.log(tl.where(is_valid, sq, 1.0)), 0.0))
    tl.store(mean_ptr + row, tl.where(is_valid, zsum / n_cols, 0.0))
    tl.store(is_top1_ptr + row, (is_valid & (best_idx == target)).to(tl.uint8))
