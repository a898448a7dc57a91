"""Tiled distillation, the statistics passes: per token, no logits of either model in memory."""
import triton
import triton.language as tl

from .common import tile_rows
from .distill_math import (jsd_finish, jsd_init, jsd_update, row_results, row_targets, stats_init,
                           stats_update)
from .distill_tiles import head_tiles


@triton.jit
def distill_tiled_stats_kernel(
    # pointers
    s_hidden_ptr,     # [n_rows, s_n_hidden] student hidden states, fp32/bf16/fp16, last dim contiguous
    s_weight_ptr,     # [n_cols, s_n_hidden] student head, s_hidden's dtype, last dim contiguous
    s_bias_ptr,       # [n_cols] student bias (HAS_S_BIAS)
    t_hidden_ptr,     # [n_rows, t_n_hidden] teacher hidden states, last dim contiguous
    t_weight_ptr,     # [n_cols, t_n_hidden] teacher head, t_hidden's dtype
    t_bias_ptr,       # [n_cols] teacher bias (HAS_T_BIAS)
    target_ptr,       # [n_rows] int64 (HAS_TARGET)
    loss_ptr,         # [n_rows] fp32 out: the per-row loss (pass 1 of 2 for MODE 2)
    stats_ptr,        # [4, n_rows] fp32 out: lse_u, lse_w, lse_c, rowsum (distill_math.row_results)
    # sizes
    n_rows, n_cols, s_n_hidden, t_n_hidden,
    # strides (elements)
    stride_s_hidden, stride_s_weight, stride_t_hidden, stride_t_weight, stride_target,
    # options (runtime fp32; changing them does not recompile)
    beta, inv_t, hard_w, s_cap, t_cap,
    ignore_index,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    MODE: tl.constexpr, HAS_TARGET: tl.constexpr, HAS_HARD: tl.constexpr, HARD_OWN_LSE: tl.constexpr,
    HAS_S_CAP: tl.constexpr, HAS_T_CAP: tl.constexpr, HAS_S_BIAS: tl.constexpr, HAS_T_BIAS: tl.constexpr,
    S_DOT_PRECISION: tl.constexpr, T_DOT_PRECISION: tl.constexpr,
    S_UPCAST: tl.constexpr = False, T_UPCAST: tl.constexpr = False,            # interpreter only
    S_ROUND_BF16: tl.constexpr = False, T_ROUND_BF16: tl.constexpr = False,    # unused: the logits tiles stay fp32
):
    rows, in_rows = tile_rows(tl.program_id(0) * BLOCK_N, n_rows, BLOCK_N)
    target, live = row_targets(target_ptr, rows, in_rows, stride_target, ignore_index, BLOCK_N, HAS_TARGET)
    n_scan = tl.where(tl.max(live.to(tl.int32), axis=0) > 0, n_cols, 0)   # all ignored: no work
    m_u, s_u, m_w, s_w, acc, m_c, s_c, c_t = stats_init(BLOCK_N)
    for v0 in range(0, n_scan, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        c, u, w = head_tiles(s_hidden_ptr, s_weight_ptr, s_bias_ptr, t_hidden_ptr, t_weight_ptr, t_bias_ptr,
                             rows, live, cols, cols < n_cols, s_n_hidden, t_n_hidden, stride_s_hidden,
                             stride_s_weight, stride_t_hidden, stride_t_weight, inv_t, s_cap, t_cap,
                             BLOCK_N, BLOCK_V, BLOCK_H, HAS_S_BIAS, HAS_T_BIAS, HAS_S_CAP, HAS_T_CAP,
                             S_DOT_PRECISION, T_DOT_PRECISION, S_UPCAST, T_UPCAST)
        m_u, s_u, m_w, s_w, acc, m_c, s_c, c_t = stats_update(
            u, w, c, cols[None, :] == target[:, None], m_u, s_u, m_w, s_w, acc, m_c, s_c, c_t,
            MODE, HAS_HARD, HARD_OWN_LSE)
    loss, lse_u, lse_w, lse_c, rowsum = row_results(m_u, s_u, m_w, s_w, acc, m_c, s_c, c_t, live, hard_w,
                                                    MODE, HAS_HARD, HARD_OWN_LSE)
    tl.store(loss_ptr + rows, loss, mask=in_rows)
    tl.store(stats_ptr + rows, lse_u, mask=in_rows)
    tl.store(stats_ptr + n_rows + rows, lse_w, mask=in_rows)
    tl.store(stats_ptr + 2 * n_rows + rows, lse_c, mask=in_rows)
    tl.store(stats_ptr + 3 * n_rows + rows, rowsum, mask=in_rows)


@triton.jit
def distill_tiled_jsd_kernel(
    # pointers (as distill_tiled_stats_kernel; loss and stats from its launch, updated in place)
    s_hidden_ptr, s_weight_ptr, s_bias_ptr, t_hidden_ptr, t_weight_ptr, t_bias_ptr, target_ptr,
    loss_ptr,         # [n_rows] fp32 in/out: the hard-label part in, the whole loss out
    stats_ptr,        # [4, n_rows] fp32: lse_u, lse_w read; rowsum written
    # sizes
    n_rows, n_cols, s_n_hidden, t_n_hidden,
    # strides (elements)
    stride_s_hidden, stride_s_weight, stride_t_hidden, stride_t_weight, stride_target,
    # options (runtime)
    beta, inv_t, hard_w, s_cap, t_cap,
    ignore_index,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_TARGET: tl.constexpr, HAS_S_CAP: tl.constexpr, HAS_T_CAP: tl.constexpr,
    HAS_S_BIAS: tl.constexpr, HAS_T_BIAS: tl.constexpr,
    S_DOT_PRECISION: tl.constexpr, T_DOT_PRECISION: tl.constexpr,
    S_UPCAST: tl.constexpr = False, T_UPCAST: tl.constexpr = False,            # interpreter only
    S_ROUND_BF16: tl.constexpr = False, T_ROUND_BF16: tl.constexpr = False,    # unused: the logits tiles stay fp32
):
    rows, in_rows = tile_rows(tl.program_id(0) * BLOCK_N, n_rows, BLOCK_N)
    target, live = row_targets(target_ptr, rows, in_rows, stride_target, ignore_index, BLOCK_N, HAS_TARGET)
    n_scan = tl.where(tl.max(live.to(tl.int32), axis=0) > 0, n_cols, 0)
    lse_u = tl.load(stats_ptr + rows, mask=in_rows, other=0.0)
    lse_w = tl.load(stats_ptr + n_rows + rows, mask=in_rows, other=0.0)
    log_beta, log_1mb, kl_t, kl_s = jsd_init(beta, BLOCK_N)
    for v0 in range(0, n_scan, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        c, u, w = head_tiles(s_hidden_ptr, s_weight_ptr, s_bias_ptr, t_hidden_ptr, t_weight_ptr, t_bias_ptr,
                             rows, live, cols, cols < n_cols, s_n_hidden, t_n_hidden, stride_s_hidden,
                             stride_s_weight, stride_t_hidden, stride_t_weight, inv_t, s_cap, t_cap,
                             BLOCK_N, BLOCK_V, BLOCK_H, HAS_S_BIAS, HAS_T_BIAS, HAS_S_CAP, HAS_T_CAP,
                             S_DOT_PRECISION, T_DOT_PRECISION, S_UPCAST, T_UPCAST)
        kl_t, kl_s = jsd_update(kl_t, kl_s, u, w, lse_u, lse_w, log_beta, log_1mb)
    divergence, rowsum = jsd_finish(kl_t, kl_s, beta, live)
    loss = tl.load(loss_ptr + rows, mask=in_rows, other=0.0)
    tl.store(loss_ptr + rows, loss + divergence, mask=in_rows)
    tl.store(stats_ptr + 3 * n_rows + rows, rowsum, mask=in_rows)
