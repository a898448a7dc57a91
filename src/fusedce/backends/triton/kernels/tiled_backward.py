"""Tiled LM-head cross-entropy backward: no logits or gradient-of-logits tensor of any size."""
import triton
import triton.language as tl

from .common import tile_rows
from .tile_grads import any_nonzero, dot_operand, operand_slice
from .tile_math import tile_targets
from .tiled_dlogits import recompute_dx


@triton.jit
def atomic_products(dx, hidden_ptr, weight_ptr, rows, row_mask, out_mask, cols, col_mask, n_hidden,
                    stride_hidden, stride_weight, grad_hidden_ptr, grad_weight_ptr, grad_bias_ptr,
                    BLOCK_H: tl.constexpr, NEED_GRAD_HIDDEN: tl.constexpr, NEED_GRAD_WEIGHT: tl.constexpr,
                    NEED_GRAD_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Add the tile's three products (``tile_grads``' docstring) with fp32 atomics into zeroed fp32 ``grad_hidden`` (n,
    H), ``grad_weight`` (V, H) and ``grad_bias`` (V,), each only when asked for (also the atomic distillation
    gradient's, ``distill_tiled_grad``)."""
    if NEED_GRAD_BIAS:
        tl.atomic_add(grad_bias_ptr + cols, tl.sum(dx, axis=0), mask=col_mask)
    op = dot_operand(dx, hidden_ptr, UPCAST)
    h_rows = hidden_ptr + rows[:, None] * stride_hidden
    w_rows = weight_ptr + cols.to(tl.int64)[:, None] * stride_weight
    for k0 in range(0, n_hidden, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < n_hidden
        if NEED_GRAD_HIDDEN:
            wt = operand_slice(w_rows, ks, col_mask, k_mask, UPCAST)
            dh = tl.dot(op, wt, input_precision=DOT_PRECISION)
            tl.atomic_add(grad_hidden_ptr + rows[:, None] * n_hidden + ks[None, :], dh,
                          mask=out_mask[:, None] & k_mask[None, :])
        if NEED_GRAD_WEIGHT:
            ht = operand_slice(h_rows, ks, row_mask, k_mask, UPCAST)
            dw = tl.dot(tl.trans(op), ht, input_precision=DOT_PRECISION)
            tl.atomic_add(grad_weight_ptr + cols.to(tl.int64)[:, None] * n_hidden + ks[None, :], dw,
                          mask=col_mask[:, None] & k_mask[None, :])


@triton.jit
def tiled_backward_kernel(
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
    grad_hidden_ptr,   # [n_rows, n_hidden] fp32, zeroed, accumulated atomically (NEED_GRAD_HIDDEN)
    grad_weight_ptr,   # [n_cols, n_hidden] fp32, zeroed, accumulated atomically (NEED_GRAD_WEIGHT)
    grad_bias_ptr,     # [n_cols] fp32, zeroed, accumulated atomically (NEED_GRAD_BIAS)
    # sizes
    n_rows, n_cols, n_hidden,
    # strides (elements)
    stride_hidden, stride_weight, stride_target, stride_grad_row, stride_grad_lse, stride_grad_entropy,
    # loss options (``options.LossScalars``: runtime, fp32 but ignore_index; changing them does not recompile)
    scalars,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    FLAGS: tl.constexpr,  # the loss options' code paths (options.LossFlags: HAS_WEIGHT, HAS_SMOOTHING, ...)
    HAS_BIAS: tl.constexpr,
    HAS_GRAD_LSE: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
    NEED_GRAD_HIDDEN: tl.constexpr, NEED_GRAD_WEIGHT: tl.constexpr, NEED_GRAD_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr = False,            # interpreter only (tile_math.logits_tile)
    ROUND_BF16: tl.constexpr = False,        # interpreter only (tile_math.round_like)
):
    rows, in_rows = tile_rows(tl.program_id(0) * BLOCK_N, n_rows, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < n_cols
    target, is_valid, _in_range, w_t = tile_targets(target_ptr, rows, in_rows, stride_target, class_weight_ptr,
                                                    n_cols, scalars, FLAGS, BLOCK_N)
    if tl.max(is_valid.to(tl.int32), axis=0) > 0:   # a tile of ignored rows: zero gradient, no work
        dx = recompute_dx(hidden_ptr, weight_ptr, bias_ptr, rows, in_rows, is_valid, cols, col_mask, target,
                          w_t, lse_ptr, lse_lo_ptr, grad_row_ptr, grad_lse_ptr, grad_entropy_ptr, entropy_ptr,
                          class_weight_ptr, weight_sum_ptr, n_cols, n_hidden, stride_hidden, stride_weight,
                          stride_grad_row, stride_grad_lse, stride_grad_entropy, scalars, FLAGS, BLOCK_N, BLOCK_V,
                          BLOCK_H, HAS_BIAS, HAS_GRAD_LSE, HAS_GRAD_ENTROPY, DOT_PRECISION, UPCAST, ROUND_BF16)
        if any_nonzero(dx):   # an exactly-zero tile adds nothing
            atomic_products(dx, hidden_ptr, weight_ptr, rows, is_valid, in_rows & is_valid, cols, col_mask,
                            n_hidden, stride_hidden, stride_weight, grad_hidden_ptr, grad_weight_ptr, grad_bias_ptr,
                            BLOCK_H, NEED_GRAD_HIDDEN, NEED_GRAD_WEIGHT, NEED_GRAD_BIAS, DOT_PRECISION, UPCAST)
