"""Tile helpers of the tiled (no-logits) distillation kernels (``distill_tiled_stats``, ``distill_tiled_grad``): the
two heads' logits tiles recomputed on chip."""
import triton
import triton.language as tl

from .distill_math import capped_pair
from .tile_math import logits_tile


@triton.jit
def head_tiles(s_hidden_ptr, s_weight_ptr, s_bias_ptr, t_hidden_ptr, t_weight_ptr, t_bias_ptr,
               rows, live, cols, col_mask, s_n_hidden, t_n_hidden,
               stride_s_hidden, stride_s_weight, stride_t_hidden, stride_t_weight, inv_t, s_cap, t_cap,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
               HAS_S_BIAS: tl.constexpr, HAS_T_BIAS: tl.constexpr, HAS_S_CAP: tl.constexpr,
               HAS_T_CAP: tl.constexpr, S_DOT_PRECISION: tl.constexpr, T_DOT_PRECISION: tl.constexpr,
               S_UPCAST: tl.constexpr, T_UPCAST: tl.constexpr):
    """``(c, u, w)``, fp32 (BLOCK_N, BLOCK_V): the student's capped logits ``c``, ``u = c / T`` and the
    teacher's capped logits at T, -inf on rows not ``live`` and columns not ``col_mask`` (rows not live
    read no hidden state)."""
    xs = logits_tile(s_hidden_ptr, s_weight_ptr, s_bias_ptr, rows, live, cols, col_mask, s_n_hidden,
                     stride_s_hidden, stride_s_weight, BLOCK_N, BLOCK_V, BLOCK_H, HAS_S_BIAS, S_DOT_PRECISION,
                     S_UPCAST)
    xt = logits_tile(t_hidden_ptr, t_weight_ptr, t_bias_ptr, rows, live, cols, col_mask, t_n_hidden,
                     stride_t_hidden, stride_t_weight, BLOCK_N, BLOCK_V, BLOCK_H, HAS_T_BIAS, T_DOT_PRECISION,
                     T_UPCAST)
    return capped_pair(xs, xt, live[:, None] & col_mask[None, :], inv_t, s_cap, t_cap, HAS_S_CAP, HAS_T_CAP)
