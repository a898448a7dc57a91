"""Distillation loss (and student-logit gradient) over rows whose logits are in memory.

Grid: one program per tile of BLOCK_N rows (BLOCK_N = 1 for large V; several rows of a small
vocabulary per program), walking the vocabulary in BLOCK_V-column blocks. The math is
``distill_math`` (its docstring has the formulas): per row, in fp32 (loads upcast after loading),

  pass 1  the online softmax of the student at T (``m_u``, ``S_u``) and of the teacher (``m_w``, ``S_w``),
          for beta = 0 / 1 the divergence's running sum (the KL is then final after this pass), with a
          hard label the target's capped logit and, when T != 1, the online softmax of the capped
          student at T = 1 (HARD_OWN_LSE);
  pass 2  (0 < beta < 1 only) ``KL(t || m)`` and ``KL(s || m)``: ``log m`` needs the normalized
          probabilities, known only after pass 1;
  pass 3  (HAS_GRAD) ``grad_factor * dL/dz_s`` written in the student's dtype (rounded to nearest).

Passes over V: beta = 0 or 1: 1 for the loss, 2 with the gradient; 0 < beta < 1: 2 for the loss, 3 with
the gradient (the gradient's ``sum_v s_v g_v`` is ``(1 - beta) KL(s || m)``, a pass-2 result).
Ignored rows (target == ignore_index) are not read: loss 0, gradient exactly 0 (written). Row offsets
are int64. Padded columns load as -inf and are masked after the softcap (which maps -inf to -cap).

Bytes moved per row (V classes, s_s / s_t bytes per student / teacher logit, P passes as above):
    read  P V (s_s + s_t) (the later passes mostly from L2 for one row) + 8 (target) + 4 (grad_factor)
    write 4 (loss) + V s_s (the gradient, HAS_GRAD)
"""
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
