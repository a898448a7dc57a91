"""Fused cross-entropy forward + gradient of one chunk of logits, written over the logits: the hot path of
``linear_cross_entropy`` (mean / sum), where the upstream gradient of every row is known in forward."""
import triton
import triton.language as tl

from .common import aligned, target_terms
from .row_math import grad_block, row_forward, store_grad


@triton.jit
def ce_chunk_kernel(
    # pointers
    logits_ptr,          # [n_rows, n_cols] fp32/bf16/fp16 in: logits; out: dL/dlogits (same storage)
    target_ptr,          # [n_rows] int32/int64
    weight_ptr,          # [n_cols] class weights (FLAGS.HAS_WEIGHT)
    weight_sum_ptr,      # [1] fp32 sum of class weights (FLAGS: HAS_WEIGHT and HAS_SMOOTHING)
    grad_row_ptr,        # [n_rows] upstream gradient of each row's loss (any float dtype and stride)
    z_grad_row_ptr,      # [n_rows] upstream gradient of each row's z-loss (HAS_ZLOSS)
    loss_ptr,            # [n_rows] fp32 out: cross-entropy without z-loss, not token-scaled
    lse_ptr,             # [n_rows] fp32 out
    lse_lo_ptr,          # [n_rows] fp32 out: lse's rounding error
    predicted_ptr,       # [n_rows] int64 out (COMPUTE_STATS)
    token_weight_ptr,    # [n_rows] fp32 out: p_t (TOKEN_SCALING)
    # sizes
    n_cols,
    # strides (elements)
    stride_logits_row, stride_target, stride_grad_row, stride_z_grad_row,
    # loss options (``options.LossScalars``: runtime, fp32 but ignore_index; changing them does not recompile)
    scalars,
    # meta-parameters
    BLOCK_V: tl.constexpr,
    ALIGN: tl.constexpr,  # n_cols and stride_logits_row are multiples of ALIGN (see common.aligned)
    FLAGS: tl.constexpr,  # the loss options' code paths (options.LossFlags: HAS_WEIGHT, HAS_SMOOTHING, ...)
    COMPUTE_STATS: tl.constexpr,
    HAS_ZLOSS: tl.constexpr,  # scalars.lse_square_scale != 0: read z_grad_row, add the z-loss' gradient
    TOKEN_SCALING: tl.constexpr,
    ROUND_BF16: tl.constexpr = False,  # interpreter only: round to nearest as GPUs do (common.to_bf16_rne)
):
    n_cols = aligned(n_cols, ALIGN)
    stride_logits_row = aligned(stride_logits_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits_row
    target = tl.load(target_ptr + row * stride_target).to(tl.int64)
    is_valid, in_range, safe, w_t = target_terms(target, n_cols, weight_ptr, scalars, FLAGS)
    loss, lse, lse_lo, best_idx, z_t, _entropy = row_forward(
        row_ptr, n_cols, is_valid, in_range, safe, w_t, weight_ptr, weight_sum_ptr, scalars, FLAGS, BLOCK_V,
        COMPUTE_STATS, False)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)
    tl.store(lse_lo_ptr + row, lse_lo)
    if COMPUTE_STATS:
        tl.store(predicted_ptr + row, tl.where(is_valid, best_idx.to(tl.int64), -1))

    g = tl.load(grad_row_ptr + row * stride_grad_row).to(tl.float32)
    z_grad = 0.0
    if HAS_ZLOSS:
        z_grad = tl.load(z_grad_row_ptr + row * stride_z_grad_row).to(tl.float32)
    if TOKEN_SCALING:   # Dynamic Fine-Tuning: the row's loss times p_t, detached
        p_t = tl.where(is_valid & in_range, tl.exp((z_t - lse) - lse_lo), 0.0)
        tl.store(token_weight_ptr + row, p_t)
        g = g * p_t
        z_grad = z_grad * p_t
    h = 2.0 * scalars.lse_square_scale * lse * z_grad   # d(s lse^2)/d lse times its upstream

    n_live = tl.where(is_valid, n_cols, 0)      # ignored rows read nothing (and get zeros)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        x = tl.load(row_ptr + cols, mask=cols < n_live, other=0.0).to(tl.float32)
        dz = grad_block(x, cols, mask, target, w_t, lse, lse_lo, g, h, weight_ptr, weight_sum_ptr, n_cols,
                        scalars, FLAGS, HAS_ZLOSS)
        store_grad(row_ptr + cols, tl.where(is_valid, dz, 0.0), mask, ROUND_BF16)
