"""The gradient of one logits tile, shared by the tiled backward kernels (``tiled_backward.py``, with atomics;
``tiled_backward_owned.py``, deterministic)."""
import triton
import triton.language as tl

from .row_math import grad_block
from .tile_math import logits_tile, round_like


@triton.jit
def row_upstreams(rows, in_rows, lse_ptr, lse_lo_ptr, grad_row_ptr, grad_lse_ptr, grad_entropy_ptr, entropy_ptr,
                  stride_grad_row, stride_grad_lse, stride_grad_entropy, BLOCK_N: tl.constexpr,
                  HAS_GRAD_LSE: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr):
    """``(lse, lse_lo, g, h, k, entropy)`` fp32 (BLOCK_N,) of tokens ``rows`` (h, k, entropy 0 with flags off)."""
    lse = tl.load(lse_ptr + rows, mask=in_rows, other=0.0)
    lse_lo = tl.load(lse_lo_ptr + rows, mask=in_rows, other=0.0)
    g = tl.load(grad_row_ptr + rows * stride_grad_row, mask=in_rows, other=0.0).to(tl.float32)
    h = tl.zeros((BLOCK_N,), tl.float32)
    if HAS_GRAD_LSE:
        h = tl.load(grad_lse_ptr + rows * stride_grad_lse, mask=in_rows, other=0.0).to(tl.float32)
    k = tl.zeros((BLOCK_N,), tl.float32)
    entropy = tl.zeros((BLOCK_N,), tl.float32)
    if HAS_GRAD_ENTROPY:
        k = tl.load(grad_entropy_ptr + rows * stride_grad_entropy, mask=in_rows, other=0.0).to(tl.float32)
        entropy = tl.load(entropy_ptr + rows, mask=in_rows, other=0.0)
    return lse, lse_lo, g, h, k, entropy


@triton.jit
def dlogits_tile(x, cols, col_mask, target, is_valid, w_t, lse, lse_lo, g, h, k, entropy, class_weight_ptr,
                 weight_sum_ptr, hidden_ptr, n_cols, scalars, FLAGS: tl.constexpr, HAS_GRAD_LSE: tl.constexpr,
                 HAS_GRAD_ENTROPY: tl.constexpr, ROUND_BF16: tl.constexpr):
    """fp32 ``dL/dx`` of the logits tile ``x`` holding values of hidden's dtype (rounded once); 0 on ignored rows
    and masked columns."""
    dz = grad_block(x, cols[None, :], col_mask[None, :], target[:, None], w_t[:, None], lse[:, None],
                    lse_lo[:, None], g[:, None], h[:, None], class_weight_ptr, weight_sum_ptr, n_cols,
                    scalars, FLAGS, HAS_GRAD_LSE, k[:, None], entropy[:, None], HAS_GRAD_ENTROPY)
    dz = tl.where(is_valid[:, None] & col_mask[None, :], dz, 0.0)
    return round_like(dz, hidden_ptr, ROUND_BF16)


@triton.jit
def recompute_dx(hidden_ptr, weight_ptr, bias_ptr, rows, in_rows, is_valid, cols, col_mask, target, w_t,
                 lse_ptr, lse_lo_ptr, grad_row_ptr, grad_lse_ptr, grad_entropy_ptr, entropy_ptr, class_weight_ptr,
                 weight_sum_ptr, n_cols, n_hidden, stride_hidden, stride_weight, stride_grad_row, stride_grad_lse,
                 stride_grad_entropy, scalars, FLAGS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GRAD_LSE: tl.constexpr,
                 HAS_GRAD_ENTROPY: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 ROUND_BF16: tl.constexpr):
    """``dlogits_tile`` of the recomputed logits tile of tokens ``rows`` and classes ``cols`` (only kept rows'
    hidden states read)."""
    x = logits_tile(hidden_ptr, weight_ptr, bias_ptr, rows, is_valid, cols, col_mask, n_hidden,
                    stride_hidden, stride_weight, BLOCK_N, BLOCK_V, BLOCK_H, HAS_BIAS, DOT_PRECISION,
                    UPCAST)
    lse, lse_lo, g, h, k, entropy = row_upstreams(
        rows, in_rows, lse_ptr, lse_lo_ptr, grad_row_ptr, grad_lse_ptr, grad_entropy_ptr, entropy_ptr,
        stride_grad_row, stride_grad_lse, stride_grad_entropy, BLOCK_N, HAS_GRAD_LSE, HAS_GRAD_ENTROPY)
    return dlogits_tile(x, cols, col_mask, target, is_valid, w_t, lse, lse_lo, g, h, k, entropy,
                        class_weight_ptr, weight_sum_ptr, hidden_ptr, n_cols, scalars, FLAGS, HAS_GRAD_LSE,
                        HAS_GRAD_ENTROPY, ROUND_BF16)
