"""Cross-entropy forward with probability ("soft") targets: one program per row, ONE pass over the row."""
import triton
import triton.language as tl

from .common import aligned, running_argmax, softmax_shift, two_sum
from .row_math import z_block


@triton.jit
def probs_target_block(q_ptr, weight_ptr, cols, mask, n_cols, scalars, FLAGS: tl.constexpr):
    """``u = w ((1 - eps) q + eps / V)`` of one block of target columns, fp32, exactly 0 on masked
    columns (shared with the backward)."""
    u = tl.load(q_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if FLAGS.HAS_SMOOTHING:
        eps = scalars.label_smoothing
        u = tl.where(mask, (1.0 - eps) * u + eps / n_cols, 0.0)
    if FLAGS.HAS_WEIGHT:
        u = u * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return u


@triton.jit
def probs_forward_kernel(
    # pointers
    logits_ptr,       # [n_rows, n_cols] fp32/bf16/fp16, last dim contiguous
    q_ptr,            # [n_rows, n_cols] fp32/bf16/fp16 target probabilities, last dim contiguous
    weight_ptr,       # [n_cols] float class weights (read only if FLAGS.HAS_WEIGHT)
    loss_ptr,         # [n_rows] fp32 out: cross-entropy without the z-loss
    lse_ptr,          # [n_rows] fp32 out
    lse_lo_ptr,       # [n_rows] fp32 out: lse's rounding error (lse + lse_lo = m + log(s) exactly)
    a_ptr,            # [n_rows] fp32 out: A = sum_c u_c (the backward's softmax factor)
    predicted_ptr,    # [n_rows] int64 out: argmax of the raw logits (written only if COMPUTE_STATS)
    # sizes
    n_cols,
    # strides (elements)
    stride_logits_row, stride_q_row,
    # loss options (``options.LossScalars``: runtime fp32; ignore_index unused: no row is ignored)
    scalars,
    # meta-parameters
    BLOCK_V: tl.constexpr,
    ALIGN: tl.constexpr,  # n_cols and both row strides are multiples of ALIGN (see common.aligned)
    FLAGS: tl.constexpr,  # the loss options' code paths (options.LossFlags)
    COMPUTE_STATS: tl.constexpr,
):
    n_cols = aligned(n_cols, ALIGN)
    stride_logits_row = aligned(stride_logits_row, ALIGN)
    stride_q_row = aligned(stride_q_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits_row
    q_row_ptr = q_ptr + row * stride_q_row
    m = -float("inf")
    s = 0.0
    a = 0.0
    b = 0.0
    best = -float("inf")
    best_idx = 0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        x, z = z_block(row_ptr, cols, mask, scalars, FLAGS)
        u = probs_target_block(q_row_ptr, weight_ptr, cols, mask, n_cols, scalars, FLAGS)
        # while every logit so far is -inf the shift is 0: the sums hold only exact zeros or -inf
        # terms, which re-basing leaves as they are
        m_new, shift = softmax_shift(m, z, 0)
        d = tl.where(m == -float("inf"), 0.0, m - shift)
        b = b + a * d + tl.sum(u * tl.where(u == 0.0, 0.0, z - shift), axis=0)
        a += tl.sum(u, axis=0)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        m = m_new
        if COMPUTE_STATS:
            best, best_idx = running_argmax(best, best_idx, x, start, 0)
    log_s = tl.log(s)
    lse, lse_lo = two_sum(m, log_s)
    tl.store(loss_ptr + row, a * log_s - b)
    tl.store(lse_ptr + row, lse)
    tl.store(lse_lo_ptr + row, lse_lo)
    tl.store(a_ptr + row, a)
    if COMPUTE_STATS:
        tl.store(predicted_ptr + row, best_idx.to(tl.int64))
