"""Partial row statistics of a vocabulary slice (vocab parallelism): one program per row of the slice's logits ``(n,
V_r)``, global columns ``[col_start, col_start + V_r)``."""
import triton
import triton.language as tl

from .common import aligned
from .row_math import logit_transform, row_stats


@triton.jit
def ce_slice_stats_kernel(
    # pointers
    logits_ptr,          # [n_rows, n_cols] fp32/bf16/fp16: this slice's logits, last dim contiguous
    target_ptr,          # [n_rows] int32/int64 GLOBAL class ids
    weight_ptr,          # [n_cols] this slice's class weights (FLAGS: HAS_WEIGHT and HAS_SMOOTHING)
    xmax_ptr, argmax_ptr, zmax_ptr, sumexp_ptr, target_logit_ptr, zsum_ptr,   # [n_rows] out
    tsum_ptr,            # [n_rows] out (COMPUTE_ENTROPY)
    # sizes
    n_cols, col_start,
    # strides (elements)
    stride_logits_row, stride_target,
    # loss options (``options.LossScalars``: runtime, fp32 but ignore_index; changing them does not recompile)
    scalars,
    # meta-parameters
    BLOCK_V: tl.constexpr,
    ALIGN: tl.constexpr,  # n_cols and stride_logits_row are multiples of ALIGN (see common.aligned)
    FLAGS: tl.constexpr,  # the loss options' code paths (options.LossFlags: HAS_WEIGHT, HAS_SMOOTHING, ...)
    COMPUTE_ENTROPY: tl.constexpr = False,   # also write tsum
):
    n_cols = aligned(n_cols, ALIGN)
    stride_logits_row = aligned(stride_logits_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits_row
    target = tl.load(target_ptr + row * stride_target).to(tl.int64)
    is_valid = target != scalars.ignore_index
    local = target - col_start
    owned = is_valid & (local >= 0) & (local < n_cols)
    m, s, zsum, best, best_idx, t = row_stats(row_ptr, n_cols, tl.where(is_valid, n_cols, 0), weight_ptr,
                                              scalars, FLAGS, BLOCK_V, True, COMPUTE_ENTROPY)
    z_t = logit_transform(tl.load(row_ptr + tl.where(owned, local, 0)).to(tl.float32), scalars, FLAGS)
    tl.store(xmax_ptr + row, best)
    tl.store(argmax_ptr + row, best_idx.to(tl.int64) + col_start)
    tl.store(zmax_ptr + row, m)
    tl.store(sumexp_ptr + row, s)
    tl.store(target_logit_ptr + row, tl.where(owned, z_t, 0.0))
    if FLAGS.HAS_SMOOTHING:
        tl.store(zsum_ptr + row, zsum)
    if COMPUTE_ENTROPY:
        tl.store(tsum_ptr + row, t)
