"""Cross-entropy backward: 2-D grid (row, vocabulary block), recomputes softmax from the saved lse."""
import triton
import triton.language as tl

from .common import aligned, target_terms
from .row_math import grad_block, store_grad


@triton.jit
def ce_backward_kernel(
    # pointers
    logits_ptr,       # [n_rows, n_cols] fp32/bf16/fp16, last dim contiguous
    grad_ptr,         # [n_rows, n_cols] out, logits' dtype; may equal logits_ptr (in-place)
    target_ptr,       # [n_rows] int32/int64
    weight_ptr,       # [n_cols] class weights (FLAGS.HAS_WEIGHT)
    weight_sum_ptr,   # [1] fp32 sum of class weights (FLAGS: HAS_WEIGHT and HAS_SMOOTHING)
    lse_ptr,          # [n_rows] fp32 from the forward
    lse_lo_ptr,       # [n_rows] fp32 from the forward: lse's rounding error
    grad_row_ptr,     # [n_rows] upstream gradient of the loss (any float dtype, any stride, 0 allowed)
    grad_lse_ptr,     # [n_rows] upstream gradient of the lse (HAS_GRAD_LSE; any float dtype and stride)
    target_weight_ptr,  # [n_rows] fp32 w_t per row (HAS_TARGET_WEIGHT: a vocabulary slice with weights)
    grad_entropy_ptr,   # [n_rows] upstream gradient of the entropy (HAS_GRAD_ENTROPY; any float dtype, stride)
    entropy_ptr,        # [n_rows] fp32 entropy from the forward (HAS_GRAD_ENTROPY)
    # sizes: this block of columns is [col_start, col_start + n_cols) of a vocabulary of n_total classes
    n_cols, col_start, n_total,
    # strides (elements)
    stride_logits_row, stride_grad_row, stride_target, stride_grad_row_vec, stride_grad_lse,
    stride_grad_entropy,
    # loss options (``options.LossScalars``: runtime, fp32 but ignore_index; changing them does not recompile)
    scalars,
    # meta-parameters
    BLOCK_V: tl.constexpr,
    ALIGN: tl.constexpr,  # n_cols and both row strides are multiples of ALIGN (see common.aligned)
    FLAGS: tl.constexpr,  # the loss options' code paths (options.LossFlags: HAS_WEIGHT, HAS_SMOOTHING, ...)
    HAS_GRAD_LSE: tl.constexpr, HAS_TARGET_WEIGHT: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr = False,
    ROUND_BF16: tl.constexpr = False,  # interpreter only: round to nearest as GPUs do (common.to_bf16_rne)
):
    n_cols = aligned(n_cols, ALIGN)
    stride_logits_row = aligned(stride_logits_row, ALIGN)
    stride_grad_row = aligned(stride_grad_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < n_cols
    target = tl.load(target_ptr + row * stride_target).to(tl.int64)
    # the target's column in this block is target - col_start (outside [0, n_cols) when another slice
    # holds it); with class weights, w_t comes from the rank that holds the target (HAS_TARGET_WEIGHT:
    # the load of target_terms, then unused, is dead code the compiler drops) or from weight[t]
    is_valid, _owned, _safe, w_t = target_terms(target, n_cols, weight_ptr, scalars, FLAGS, col_start)
    if HAS_TARGET_WEIGHT:
        w_t = tl.load(target_weight_ptr + row)

    live = cols < tl.where(is_valid, n_cols, 0)      # ignored rows read nothing
    x = tl.load(logits_ptr + row * stride_logits_row + cols, mask=live, other=0.0).to(tl.float32)
    g = tl.load(grad_row_ptr + row * stride_grad_row_vec).to(tl.float32)
    h = 0.0
    if HAS_GRAD_LSE:
        h = tl.load(grad_lse_ptr + row * stride_grad_lse).to(tl.float32)
    k = 0.0
    entropy = 0.0
    if HAS_GRAD_ENTROPY:
        k = tl.load(grad_entropy_ptr + row * stride_grad_entropy).to(tl.float32)
        entropy = tl.load(entropy_ptr + row)
    dz = grad_block(x, cols, mask, target - col_start, w_t, tl.load(lse_ptr + row), tl.load(lse_lo_ptr + row),
                    g, h, weight_ptr, weight_sum_ptr, n_total, scalars, FLAGS, HAS_GRAD_LSE, k, entropy,
                    HAS_GRAD_ENTROPY)
    store_grad(grad_ptr + row * stride_grad_row + cols, tl.where(is_valid, dz, 0.0), mask, ROUND_BF16)
