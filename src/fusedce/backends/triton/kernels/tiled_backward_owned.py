"""Deterministic tiled LM-head cross-entropy backward: two kernels, each the only writer of its gradient
(``method="tiled"`` with ``deterministic=True`` or ``torch.are_deterministic_algorithms_enabled()``)."""
import triton
import triton.language as tl

from .common import tile_rows
from .tile_grads import add_grad_hidden, add_grad_weight, any_nonzero
from .tile_math import logits_tile, tile_targets
from .tiled_dlogits import dlogits_tile, recompute_dx, row_upstreams


@triton.jit
def tiled_grad_hidden_kernel(
    # pointers
    hidden_ptr,        # [n_rows, n_hidden] fp32/bf16/fp16, last dim contiguous
    weight_ptr,        # [n_cols, n_hidden] hidden's dtype, last dim contiguous
    bias_ptr,          # [n_cols] hidden's dtype (HAS_BIAS)
    target_ptr,        # [n_rows] int32/int64
    class_weight_ptr,  # [n_cols] fp32 class weights (FLAGS.HAS_WEIGHT)
    weight_sum_ptr,    # [1] fp32 sum of the class weights (FLAGS: HAS_WEIGHT and HAS_SMOOTHING)
    lse_ptr,           # [n_rows] fp32 from the forward
    lse_lo_ptr,        # [n_rows] fp32 from the forward
    grad_row_ptr,      # [n_rows] upstream gradient of the loss (any float dtype, any stride)
    grad_lse_ptr,      # [n_rows] upstream gradient of the lse (HAS_GRAD_LSE)
    grad_entropy_ptr,  # [n_rows] upstream gradient of the entropy (HAS_GRAD_ENTROPY)
    entropy_ptr,       # [n_rows] fp32 entropy from the forward (HAS_GRAD_ENTROPY)
    grad_hidden_ptr,   # [n_rows, n_hidden] fp32, zeroed; this program's rows written by it alone
    # sizes
    n_rows, n_cols, n_hidden,
    # strides (elements)
    stride_hidden, stride_weight, stride_target, stride_grad_row, stride_grad_lse, stride_grad_entropy,
    # loss options (``options.LossScalars``: runtime values)
    scalars,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    FLAGS: tl.constexpr,  # the loss options' code paths (options.LossFlags)
    HAS_BIAS: tl.constexpr, HAS_GRAD_LSE: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr = False,            # interpreter only (tile_math.logits_tile)
    ROUND_BF16: tl.constexpr = False,        # interpreter only (tile_math.round_like)
):
    rows, in_rows = tile_rows(tl.program_id(0) * BLOCK_N, n_rows, BLOCK_N)
    target, is_valid, _in_range, w_t = tile_targets(target_ptr, rows, in_rows, stride_target, class_weight_ptr,
                                                    n_cols, scalars, FLAGS, BLOCK_N)
    n_scan = tl.where(tl.max(is_valid.to(tl.int32), axis=0) > 0, n_cols, 0)   # all ignored: no work
    lse, lse_lo, g, h, k, entropy = row_upstreams(
        rows, in_rows, lse_ptr, lse_lo_ptr, grad_row_ptr, grad_lse_ptr, grad_entropy_ptr, entropy_ptr,
        stride_grad_row, stride_grad_lse, stride_grad_entropy, BLOCK_N, HAS_GRAD_LSE, HAS_GRAD_ENTROPY)
    out_rows = grad_hidden_ptr + rows[:, None] * n_hidden
    out_mask = in_rows & is_valid
    for v0 in range(0, n_scan, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < n_cols
        x = logits_tile(hidden_ptr, weight_ptr, bias_ptr, rows, is_valid, cols, col_mask, n_hidden,
                        stride_hidden, stride_weight, BLOCK_N, BLOCK_V, BLOCK_H, HAS_BIAS, DOT_PRECISION,
                        UPCAST)
        dx = dlogits_tile(x, cols, col_mask, target, is_valid, w_t, lse, lse_lo, g, h, k, entropy,
                          class_weight_ptr, weight_sum_ptr, hidden_ptr, n_cols, scalars, FLAGS, HAS_GRAD_LSE,
                          HAS_GRAD_ENTROPY, ROUND_BF16)
        if any_nonzero(dx):   # an exactly-zero tile adds nothing
            add_grad_hidden(dx, hidden_ptr, weight_ptr, out_rows, out_mask, cols, col_mask, n_hidden, stride_weight,
                            BLOCK_H, DOT_PRECISION, UPCAST)


@triton.jit
def tiled_grad_weight_kernel(
    # pointers
    hidden_ptr,        # [n_rows, n_hidden] fp32/bf16/fp16, last dim contiguous
    weight_ptr,        # [n_cols, n_hidden] hidden's dtype, last dim contiguous
    bias_ptr,          # [n_cols] hidden's dtype (HAS_BIAS)
    target_ptr,        # [n_rows] int32/int64
    class_weight_ptr,  # [n_cols] fp32 class weights (FLAGS.HAS_WEIGHT)
    weight_sum_ptr,    # [1] fp32 sum of the class weights (FLAGS: HAS_WEIGHT and HAS_SMOOTHING)
    lse_ptr,           # [n_rows] fp32 from the forward
    lse_lo_ptr,        # [n_rows] fp32 from the forward
    grad_row_ptr,      # [n_rows] upstream gradient of the loss (any float dtype, any stride)
    grad_lse_ptr,      # [n_rows] upstream gradient of the lse (HAS_GRAD_LSE)
    grad_entropy_ptr,  # [n_rows] upstream gradient of the entropy (HAS_GRAD_ENTROPY)
    entropy_ptr,       # [n_rows] fp32 entropy from the forward (HAS_GRAD_ENTROPY)
    grad_weight_ptr,   # [n_cols, n_hidden] fp32, zeroed; this program's rows written by it alone (NEED_GRAD_WEIGHT)
    grad_bias_ptr,     # [n_cols] fp32 out, this program's columns (NEED_GRAD_BIAS)
    # sizes
    n_rows, n_cols, n_hidden,
    # strides (elements)
    stride_hidden, stride_weight, stride_target, stride_grad_row, stride_grad_lse, stride_grad_entropy,
    # loss options (``options.LossScalars``: runtime values)
    scalars,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    FLAGS: tl.constexpr,  # the loss options' code paths (options.LossFlags)
    HAS_BIAS: tl.constexpr, HAS_GRAD_LSE: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
    NEED_GRAD_WEIGHT: tl.constexpr, NEED_GRAD_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr = False,            # interpreter only (tile_math.logits_tile)
    ROUND_BF16: tl.constexpr = False,        # interpreter only (tile_math.round_like)
):
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < n_cols
    out_cols = grad_weight_ptr + cols.to(tl.int64)[:, None] * n_hidden
    grad_bias = tl.zeros((BLOCK_V,), tl.float32)
    for n0 in range(0, n_rows, BLOCK_N):
        rows, in_rows = tile_rows(n0, n_rows, BLOCK_N)
        target, is_valid, _in_range, w_t = tile_targets(target_ptr, rows, in_rows, stride_target, class_weight_ptr,
                                                        n_cols, scalars, FLAGS, BLOCK_N)
        if tl.max(is_valid.to(tl.int32), axis=0) > 0:   # a tile of ignored rows: zero gradient, no work
            dx = recompute_dx(hidden_ptr, weight_ptr, bias_ptr, rows, in_rows, is_valid, cols, col_mask, target,
                              w_t, lse_ptr, lse_lo_ptr, grad_row_ptr, grad_lse_ptr, grad_entropy_ptr, entropy_ptr,
                              class_weight_ptr, weight_sum_ptr, n_cols, n_hidden, stride_hidden, stride_weight,
                              stride_grad_row, stride_grad_lse, stride_grad_entropy, scalars, FLAGS, BLOCK_N, BLOCK_V,
                              BLOCK_H, HAS_BIAS, HAS_GRAD_LSE, HAS_GRAD_ENTROPY, DOT_PRECISION, UPCAST, ROUND_BF16)
            if any_nonzero(dx):   # an exactly-zero tile adds nothing
                if NEED_GRAD_BIAS:
                    grad_bias += tl.sum(dx, axis=0)
                if NEED_GRAD_WEIGHT:
                    add_grad_weight(dx, hidden_ptr, rows, is_valid, out_cols, col_mask, n_hidden, stride_hidden,
                                    BLOCK_H, DOT_PRECISION, UPCAST)
    if NEED_GRAD_BIAS:
        tl.store(grad_bias_ptr + cols, grad_bias, mask=col_mask)
