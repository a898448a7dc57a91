"""Cross-entropy forward: one program per row, online softmax over vocabulary blocks."""
import triton
import triton.language as tl

from .common import aligned, target_terms
from .row_math import row_forward


@triton.jit
def ce_forward_kernel(
    # pointers
    logits_ptr,       # [n_rows, n_cols] fp32/bf16/fp16, last dim contiguous
    target_ptr,       # [n_rows] int32/int64
    weight_ptr,       # [n_cols] float class weights (read only if FLAGS.HAS_WEIGHT)
    weight_sum_ptr,   # [1] fp32, sum of the class weights (read only if HAS_WEIGHT and HAS_SMOOTHING)
    loss_ptr,         # [n_rows] fp32 out
    lse_ptr,          # [n_rows] fp32 out
    lse_lo_ptr,       # [n_rows] fp32 out: lse's rounding error (lse + lse_lo = max + log(sum) exactly)
    predicted_ptr,    # [n_rows] int64 out (written only if COMPUTE_STATS)
    entropy_ptr,      # [n_rows] fp32 out: entropy of softmax(z), 0 on ignored rows (COMPUTE_ENTROPY)
    # sizes
    n_cols,
    # strides (elements)
    stride_logits_row, stride_target,
    # loss options (``options.LossScalars``: runtime, fp32 but ignore_index; changing them does not recompile)
    scalars,
    # meta-parameters
    BLOCK_V: tl.constexpr,
    ALIGN: tl.constexpr,  # n_cols and stride_logits_row are multiples of ALIGN (see common.aligned)
    FLAGS: tl.constexpr,  # the loss options' code paths (options.LossFlags: HAS_WEIGHT, HAS_SMOOTHING, ...)
    COMPUTE_STATS: tl.constexpr,
    COMPUTE_ENTROPY: tl.constexpr = False,  # also t = sum exp(z - m)(z - m): entropy = log s - t / s
):
    n_cols = aligned(n_cols, ALIGN)
    stride_logits_row = aligned(stride_logits_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row * stride_target).to(tl.int64)
    is_valid, in_range, safe, w_t = target_terms(target, n_cols, weight_ptr, scalars, FLAGS)
    loss, lse, lse_lo, best_idx, _z_t, entropy = row_forward(
        logits_ptr + row * stride_logits_row, n_cols, is_valid, in_range, safe, w_t, weight_ptr, weight_sum_ptr,
        scalars, FLAGS, BLOCK_V, COMPUTE_STATS, COMPUTE_ENTROPY)
    if COMPUTE_ENTROPY:
        tl.store(entropy_ptr + row, entropy)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)
    tl.store(lse_lo_ptr + row, lse_lo)
    if COMPUTE_STATS:
        tl.store(predicted_ptr + row, tl.where(is_valid, best_idx.to(tl.int64), -1))
