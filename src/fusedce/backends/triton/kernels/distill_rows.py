"""Distillation loss (and student-logit gradient) over rows whose logits are in memory."""
import triton
import triton.language as tl

from .common import aligned, tile_rows
from .distill_math import (NEG_INF, capped_pair, dlogits, jsd_finish, jsd_init, jsd_update, row_results,
                           row_targets, stats_init, stats_update)
from .row_math import store_grad


@triton.jit
def _load_tile(student_rows, teacher_rows, cols, mask, inv_t, s_cap, t_cap, HAS_S_CAP: tl.constexpr,
               HAS_T_CAP: tl.constexpr):
    """``(c, u, w)`` of a (rows x columns) block: the capped student logits, ``c / T``, the teacher's at T."""
    xs = tl.load(student_rows + cols[None, :], mask=mask, other=NEG_INF).to(tl.float32)
    xt = tl.load(teacher_rows + cols[None, :], mask=mask, other=NEG_INF).to(tl.float32)
    return capped_pair(xs, xt, mask, inv_t, s_cap, t_cap, HAS_S_CAP, HAS_T_CAP)


@triton.jit
def distill_rows_kernel(
    # pointers
    student_ptr,      # [n_rows, n_cols] fp32/bf16/fp16 student logits, last dim contiguous
    teacher_ptr,      # [n_rows, n_cols] fp32/bf16/fp16 teacher logits, last dim contiguous
    target_ptr,       # [n_rows] int64 (HAS_TARGET)
    grad_factor_ptr,  # [n_rows] fp32 per-row factor of the gradient (HAS_GRAD)
    loss_ptr,         # [n_rows] fp32 out: the per-row loss (0 on ignored rows)
    grad_ptr,         # [n_rows, n_cols] out, student's dtype: grad_factor * dL/dz_s (HAS_GRAD)
    # sizes
    n_rows, n_cols,
    # strides (elements)
    stride_student, stride_teacher, stride_target, stride_grad_factor, stride_grad,
    # options (runtime fp32; changing them does not recompile)
    beta, inv_t, hard_w, s_cap, t_cap,
    ignore_index,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    ALIGN: tl.constexpr,          # n_cols and the row strides are multiples of ALIGN (common.aligned)
    MODE: tl.constexpr,           # 0: beta = 0, 1: beta = 1, 2: 0 < beta < 1 (distill_math)
    HAS_TARGET: tl.constexpr, HAS_HARD: tl.constexpr, HARD_OWN_LSE: tl.constexpr,
    HAS_S_CAP: tl.constexpr, HAS_T_CAP: tl.constexpr, HAS_GRAD: tl.constexpr,
    ROUND_BF16: tl.constexpr = False,   # interpreter only (row_math.store_grad)
):
    n_cols = aligned(n_cols, ALIGN)
    stride_student = aligned(stride_student, ALIGN)
    stride_teacher = aligned(stride_teacher, ALIGN)
    stride_grad = aligned(stride_grad, ALIGN)
    rows, in_rows = tile_rows(tl.program_id(0) * BLOCK_N, n_rows, BLOCK_N)
    target, live = row_targets(target_ptr, rows, in_rows, stride_target, ignore_index, BLOCK_N, HAS_TARGET)
    n_scan = tl.where(tl.max(live.to(tl.int32), axis=0) > 0, n_cols, 0)   # all ignored: no reads
    student_rows = student_ptr + rows[:, None] * stride_student
    teacher_rows = teacher_ptr + rows[:, None] * stride_teacher

    m_u, s_u, m_w, s_w, acc, m_c, s_c, c_t = stats_init(BLOCK_N)
    for v0 in range(0, n_scan, BLOCK_V):   # pass 1
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = live[:, None] & (cols < n_cols)[None, :]
        c, u, w = _load_tile(student_rows, teacher_rows, cols, mask, inv_t, s_cap, t_cap, HAS_S_CAP, HAS_T_CAP)
        m_u, s_u, m_w, s_w, acc, m_c, s_c, c_t = stats_update(
            u, w, c, cols[None, :] == target[:, None], m_u, s_u, m_w, s_w, acc, m_c, s_c, c_t,
            MODE, HAS_HARD, HARD_OWN_LSE)
    loss, lse_u, lse_w, lse_c, rowsum = row_results(m_u, s_u, m_w, s_w, acc, m_c, s_c, c_t, live, hard_w,
                                                    MODE, HAS_HARD, HARD_OWN_LSE)
    if MODE == 2:   # pass 2: the generalized JSD from the normalized probabilities
        log_beta, log_1mb, kl_t, kl_s = jsd_init(beta, BLOCK_N)
        for v0 in range(0, n_scan, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            mask = live[:, None] & (cols < n_cols)[None, :]
            c, u, w = _load_tile(student_rows, teacher_rows, cols, mask, inv_t, s_cap, t_cap, HAS_S_CAP,
                                 HAS_T_CAP)
            kl_t, kl_s = jsd_update(kl_t, kl_s, u, w, lse_u, lse_w, log_beta, log_1mb)
        divergence, rowsum = jsd_finish(kl_t, kl_s, beta, live)
        loss += divergence
    tl.store(loss_ptr + rows, loss, mask=in_rows)

    if HAS_GRAD:   # pass 3 (every column of every row: ignored rows get exact zeros)
        factor = tl.load(grad_factor_ptr + rows * stride_grad_factor, mask=live, other=0.0).to(tl.float32)
        grad_rows = grad_ptr + rows[:, None] * stride_grad
        for v0 in range(0, n_cols, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_mask = (cols < n_cols)[None, :]
            mask = live[:, None] & col_mask
            c, u, w = _load_tile(student_rows, teacher_rows, cols, mask, inv_t, s_cap, t_cap, HAS_S_CAP, HAS_T_CAP)
            dz = dlogits(c, u, w, cols[None, :] == target[:, None], lse_u[:, None], lse_w[:, None],
                         lse_c[:, None], rowsum[:, None], beta, inv_t, hard_w, s_cap,
                         MODE, HAS_HARD, HARD_OWN_LSE, HAS_S_CAP)
            dz = tl.where(mask, dz * factor[:, None], 0.0)
            store_grad(grad_rows + cols[None, :], dz, in_rows[:, None] & col_mask, ROUND_BF16)
