"""Tiled distillation, the gradient pass: grad_hidden, grad_weight, grad_bias of the student head with no logits (or
gradient-of-logits) tensor of any size."""
import triton
import triton.language as tl

from .common import tile_rows
from .distill_math import dlogits, row_targets
from .distill_tiles import head_tiles
from .tile_grads import add_grad_hidden, add_grad_weight, any_nonzero
from .tile_math import round_like
from .tiled_backward import atomic_products


@triton.jit
def _row_inputs(stats_ptr, grad_factor_ptr, rows, in_rows, live, n_rows, stride_grad_factor):
    """``(lse_u, lse_w, lse_c, rowsum, factor)`` fp32 (BLOCK_N,) of the token indices ``rows``; ``factor``
    0 on rows not ``live``."""
    lse_u = tl.load(stats_ptr + rows, mask=in_rows, other=0.0)
    lse_w = tl.load(stats_ptr + n_rows + rows, mask=in_rows, other=0.0)
    lse_c = tl.load(stats_ptr + 2 * n_rows + rows, mask=in_rows, other=0.0)
    rowsum = tl.load(stats_ptr + 3 * n_rows + rows, mask=in_rows, other=0.0)
    factor = tl.load(grad_factor_ptr + rows * stride_grad_factor, mask=live, other=0.0).to(tl.float32)
    return lse_u, lse_w, lse_c, rowsum, factor


@triton.jit
def _dx_tile(s_hidden_ptr, s_weight_ptr, s_bias_ptr, t_hidden_ptr, t_weight_ptr, t_bias_ptr, stats_ptr,
             grad_factor_ptr, rows, in_rows, live, target, cols, col_mask, n_rows, s_n_hidden, t_n_hidden,
             stride_s_hidden, stride_s_weight, stride_t_hidden, stride_t_weight, stride_grad_factor,
             beta, inv_t, hard_w, s_cap, t_cap,
             BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, MODE: tl.constexpr,
             HAS_HARD: tl.constexpr, HARD_OWN_LSE: tl.constexpr, HAS_S_CAP: tl.constexpr,
             HAS_T_CAP: tl.constexpr, HAS_S_BIAS: tl.constexpr, HAS_T_BIAS: tl.constexpr,
             S_DOT_PRECISION: tl.constexpr, T_DOT_PRECISION: tl.constexpr, S_UPCAST: tl.constexpr,
             T_UPCAST: tl.constexpr, S_ROUND_BF16: tl.constexpr, T_ROUND_BF16: tl.constexpr):
    """fp32 (BLOCK_N, BLOCK_V) ``grad_factor * dL/dz_s`` holding values of the student's dtype, exactly 0
    on rows not ``live`` and columns not ``col_mask``."""
    lse_u, lse_w, lse_c, rowsum, factor = _row_inputs(stats_ptr, grad_factor_ptr, rows, in_rows, live, n_rows,
                                                      stride_grad_factor)
    c, u, w = head_tiles(s_hidden_ptr, s_weight_ptr, s_bias_ptr, t_hidden_ptr, t_weight_ptr, t_bias_ptr,
                         rows, live, cols, col_mask, s_n_hidden, t_n_hidden, stride_s_hidden, stride_s_weight,
                         stride_t_hidden, stride_t_weight, inv_t, s_cap, t_cap, BLOCK_N, BLOCK_V, BLOCK_H,
                         HAS_S_BIAS, HAS_T_BIAS, HAS_S_CAP, HAS_T_CAP, S_DOT_PRECISION, T_DOT_PRECISION,
                         S_UPCAST, T_UPCAST)
    dz = dlogits(c, u, w, cols[None, :] == target[:, None], lse_u[:, None], lse_w[:, None], lse_c[:, None],
                 rowsum[:, None], beta, inv_t, hard_w, s_cap, MODE, HAS_HARD, HARD_OWN_LSE, HAS_S_CAP)
    dz = tl.where(live[:, None] & col_mask[None, :], dz * factor[:, None], 0.0)
    return round_like(dz, s_hidden_ptr, S_ROUND_BF16)


@triton.jit
def distill_tiled_grad_kernel(
    # pointers
    s_hidden_ptr, s_weight_ptr, s_bias_ptr,   # student: [n_rows, s_n_hidden], [n_cols, s_n_hidden], [n_cols]
    t_hidden_ptr, t_weight_ptr, t_bias_ptr,   # teacher: [n_rows, t_n_hidden], [n_cols, t_n_hidden], [n_cols]
    target_ptr,        # [n_rows] int64 (HAS_TARGET)
    stats_ptr,         # [4, n_rows] fp32 from the statistics kernels
    grad_factor_ptr,   # [n_rows] float, any stride
    grad_hidden_ptr,   # [n_rows, s_n_hidden] fp32, zeroed, atomics (NEED_GRAD_HIDDEN)
    grad_weight_ptr,   # [n_cols, s_n_hidden] fp32, zeroed, atomics (NEED_GRAD_WEIGHT)
    grad_bias_ptr,     # [n_cols] fp32, zeroed, atomics (NEED_GRAD_BIAS)
    # sizes
    n_rows, n_cols, s_n_hidden, t_n_hidden,
    # strides (elements)
    stride_s_hidden, stride_s_weight, stride_t_hidden, stride_t_weight, stride_target, stride_grad_factor,
    # options (runtime)
    beta, inv_t, hard_w, s_cap, t_cap,
    ignore_index,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    MODE: tl.constexpr, HAS_TARGET: tl.constexpr, HAS_HARD: tl.constexpr, HARD_OWN_LSE: tl.constexpr,
    HAS_S_CAP: tl.constexpr, HAS_T_CAP: tl.constexpr, HAS_S_BIAS: tl.constexpr, HAS_T_BIAS: tl.constexpr,
    NEED_GRAD_HIDDEN: tl.constexpr, NEED_GRAD_WEIGHT: tl.constexpr, NEED_GRAD_BIAS: tl.constexpr,
    S_DOT_PRECISION: tl.constexpr, T_DOT_PRECISION: tl.constexpr,
    S_UPCAST: tl.constexpr = False, T_UPCAST: tl.constexpr = False,            # interpreter only
    S_ROUND_BF16: tl.constexpr = False, T_ROUND_BF16: tl.constexpr = False,    # interpreter only
):
    rows, in_rows = tile_rows(tl.program_id(0) * BLOCK_N, n_rows, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < n_cols
    target, live = row_targets(target_ptr, rows, in_rows, stride_target, ignore_index, BLOCK_N, HAS_TARGET)
    if tl.max(live.to(tl.int32), axis=0) > 0:   # a tile of ignored rows: zero gradient, no work
        dx = _dx_tile(s_hidden_ptr, s_weight_ptr, s_bias_ptr, t_hidden_ptr, t_weight_ptr, t_bias_ptr, stats_ptr,
                      grad_factor_ptr, rows, in_rows, live, target, cols, col_mask, n_rows, s_n_hidden,
                      t_n_hidden, stride_s_hidden, stride_s_weight, stride_t_hidden, stride_t_weight,
                      stride_grad_factor, beta, inv_t, hard_w, s_cap, t_cap, BLOCK_N, BLOCK_V, BLOCK_H, MODE,
                      HAS_HARD, HARD_OWN_LSE, HAS_S_CAP, HAS_T_CAP, HAS_S_BIAS, HAS_T_BIAS, S_DOT_PRECISION,
                      T_DOT_PRECISION, S_UPCAST, T_UPCAST, S_ROUND_BF16, T_ROUND_BF16)
        if any_nonzero(dx):   # an exactly-zero tile adds nothing
            atomic_products(dx, s_hidden_ptr, s_weight_ptr, rows, live, live, cols, col_mask, s_n_hidden,
                            stride_s_hidden, stride_s_weight, grad_hidden_ptr, grad_weight_ptr, grad_bias_ptr,
                            BLOCK_H, NEED_GRAD_HIDDEN, NEED_GRAD_WEIGHT, NEED_GRAD_BIAS, S_DOT_PRECISION, S_UPCAST)


@triton.jit
def distill_tiled_grad_hidden_kernel(
    # pointers (as distill_tiled_grad_kernel)
    s_hidden_ptr, s_weight_ptr, s_bias_ptr, t_hidden_ptr, t_weight_ptr, t_bias_ptr, target_ptr, stats_ptr,
    grad_factor_ptr,
    grad_hidden_ptr,   # [n_rows, s_n_hidden] fp32, zeroed; this program's rows written by it alone
    # sizes
    n_rows, n_cols, s_n_hidden, t_n_hidden,
    # strides (elements)
    stride_s_hidden, stride_s_weight, stride_t_hidden, stride_t_weight, stride_target, stride_grad_factor,
    # options (runtime)
    beta, inv_t, hard_w, s_cap, t_cap,
    ignore_index,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    MODE: tl.constexpr, HAS_TARGET: tl.constexpr, HAS_HARD: tl.constexpr, HARD_OWN_LSE: tl.constexpr,
    HAS_S_CAP: tl.constexpr, HAS_T_CAP: tl.constexpr, HAS_S_BIAS: tl.constexpr, HAS_T_BIAS: tl.constexpr,
    S_DOT_PRECISION: tl.constexpr, T_DOT_PRECISION: tl.constexpr,
    S_UPCAST: tl.constexpr = False, T_UPCAST: tl.constexpr = False,            # interpreter only
    S_ROUND_BF16: tl.constexpr = False, T_ROUND_BF16: tl.constexpr = False,    # interpreter only
):
    rows, in_rows = tile_rows(tl.program_id(0) * BLOCK_N, n_rows, BLOCK_N)
    target, live = row_targets(target_ptr, rows, in_rows, stride_target, ignore_index, BLOCK_N, HAS_TARGET)
    n_scan = tl.where(tl.max(live.to(tl.int32), axis=0) > 0, n_cols, 0)   # all ignored: no work
    out_rows = grad_hidden_ptr + rows[:, None] * s_n_hidden
    for v0 in range(0, n_scan, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < n_cols
        dx = _dx_tile(s_hidden_ptr, s_weight_ptr, s_bias_ptr, t_hidden_ptr, t_weight_ptr, t_bias_ptr, stats_ptr,
                      grad_factor_ptr, rows, in_rows, live, target, cols, col_mask, n_rows, s_n_hidden,
                      t_n_hidden, stride_s_hidden, stride_s_weight, stride_t_hidden, stride_t_weight,
                      stride_grad_factor, beta, inv_t, hard_w, s_cap, t_cap, BLOCK_N, BLOCK_V, BLOCK_H, MODE,
                      HAS_HARD, HARD_OWN_LSE, HAS_S_CAP, HAS_T_CAP, HAS_S_BIAS, HAS_T_BIAS, S_DOT_PRECISION,
                      T_DOT_PRECISION, S_UPCAST, T_UPCAST, S_ROUND_BF16, T_ROUND_BF16)
        if any_nonzero(dx):   # an exactly-zero tile adds nothing
            add_grad_hidden(dx, s_hidden_ptr, s_weight_ptr, out_rows, live, cols, col_mask, s_n_hidden,
                            stride_s_weight, BLOCK_H, S_DOT_PRECISION, S_UPCAST)


@triton.jit
def distill_tiled_grad_weight_kernel(
    # pointers (as distill_tiled_grad_kernel)
    s_hidden_ptr, s_weight_ptr, s_bias_ptr, t_hidden_ptr, t_weight_ptr, t_bias_ptr, target_ptr, stats_ptr,
    grad_factor_ptr,
    grad_weight_ptr,   # [n_cols, s_n_hidden] fp32, zeroed; this program's rows written by it alone (NEED_GRAD_WEIGHT)
    grad_bias_ptr,     # [n_cols] fp32 out, this program's columns, written whole (NEED_GRAD_BIAS)
    # sizes
    n_rows, n_cols, s_n_hidden, t_n_hidden,
    # strides (elements)
    stride_s_hidden, stride_s_weight, stride_t_hidden, stride_t_weight, stride_target, stride_grad_factor,
    # options (runtime)
    beta, inv_t, hard_w, s_cap, t_cap,
    ignore_index,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    MODE: tl.constexpr, HAS_TARGET: tl.constexpr, HAS_HARD: tl.constexpr, HARD_OWN_LSE: tl.constexpr,
    HAS_S_CAP: tl.constexpr, HAS_T_CAP: tl.constexpr, HAS_S_BIAS: tl.constexpr, HAS_T_BIAS: tl.constexpr,
    NEED_GRAD_WEIGHT: tl.constexpr, NEED_GRAD_BIAS: tl.constexpr,
    S_DOT_PRECISION: tl.constexpr, T_DOT_PRECISION: tl.constexpr,
    S_UPCAST: tl.constexpr = False, T_UPCAST: tl.constexpr = False,            # interpreter only
    S_ROUND_BF16: tl.constexpr = False, T_ROUND_BF16: tl.constexpr = False,    # interpreter only
):
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < n_cols
    out_cols = grad_weight_ptr + cols.to(tl.int64)[:, None] * s_n_hidden
    grad_bias = tl.zeros((BLOCK_V,), tl.float32)
    for n0 in range(0, n_rows, BLOCK_N):
        rows, in_rows = tile_rows(n0, n_rows, BLOCK_N)
        target, live = row_targets(target_ptr, rows, in_rows, stride_target, ignore_index, BLOCK_N, HAS_TARGET)
        if tl.max(live.to(tl.int32), axis=0) > 0:   # a tile of ignored rows: zero gradient, no work
            dx = _dx_tile(s_hidden_ptr, s_weight_ptr, s_bias_ptr, t_hidden_ptr, t_weight_ptr, t_bias_ptr,
                          stats_ptr, grad_factor_ptr, rows, in_rows, live, target, cols, col_mask, n_rows,
                          s_n_hidden, t_n_hidden, stride_s_hidden, stride_s_weight, stride_t_hidden,
                          stride_t_weight, stride_grad_factor, beta, inv_t, hard_w, s_cap, t_cap, BLOCK_N,
                          BLOCK_V, BLOCK_H, MODE, HAS_HARD, HARD_OWN_LSE, HAS_S_CAP, HAS_T_CAP, HAS_S_BIAS,
                          HAS_T_BIAS, S_DOT_PRECISION, T_DOT_PRECISION, S_UPCAST, T_UPCAST, S_ROUND_BF16,
                          T_ROUND_BF16)
            if any_nonzero(dx):   # an exactly-zero tile adds nothing
                if NEED_GRAD_BIAS:
                    grad_bias += tl.sum(dx, axis=0)
                if NEED_GRAD_WEIGHT:
                    add_grad_weight(dx, s_hidden_ptr, rows, live, out_cols, col_mask, s_n_hidden, stride_s_hidden,
                                    BLOCK_H, S_DOT_PRECISION, S_UPCAST)
    if NEED_GRAD_BIAS:
        tl.store(grad_bias_ptr + cols, grad_bias, mask=col_mask)
