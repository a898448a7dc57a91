"""Tiled LM-head cross-entropy forward: no logits tensor of any size (``method="tiled"``)."""
import triton
import triton.language as tl

from .common import running_argmax, softmax_shift, tile_rows
from .row_math import entropy_of, entropy_rebase, entropy_terms, logit_transform, row_lse, row_loss
from .tile_math import logits_tile, tile_targets


@triton.jit
def tiled_forward_kernel(
    # pointers
    hidden_ptr,        # [n_rows, n_hidden] fp32/bf16/fp16, last dim contiguous
    weight_ptr,        # [n_cols, n_hidden] hidden's dtype, last dim contiguous
    bias_ptr,          # [n_cols] hidden's dtype (HAS_BIAS)
    target_ptr,        # [n_rows] int32/int64
    class_weight_ptr,  # [n_cols] fp32 class weights (FLAGS.HAS_WEIGHT)
    weight_sum_ptr,    # [1] fp32 sum of the class weights (FLAGS: HAS_WEIGHT and HAS_SMOOTHING)
    loss_ptr,          # [n_rows] fp32 out: cross-entropy without z-loss
    lse_ptr,           # [n_rows] fp32 out
    lse_lo_ptr,        # [n_rows] fp32 out: lse's rounding error
    predicted_ptr,     # [n_rows] int64 out: argmax of the logits (COMPUTE_STATS)
    target_logit_ptr,  # [n_rows] fp32 out: z_t (0 on ignored rows and out-of-range targets)
    entropy_ptr,       # [n_rows] fp32 out (COMPUTE_ENTROPY)
    log_sum_sq_ptr,    # [n_rows] fp32 out: log sum_c p_c**2 (COMPUTE_TOKEN_STATS)
    mean_ptr,          # [n_rows] fp32 out: sum_c z_c / V (COMPUTE_TOKEN_STATS)
    is_top1_ptr,       # [n_rows] uint8 out: first argmax of z == target (COMPUTE_TOKEN_STATS)
    # sizes
    n_rows, n_cols, n_hidden,
    # strides (elements)
    stride_hidden, stride_weight, stride_target,
    # loss options (``options.LossScalars``: runtime, fp32 but ignore_index; changing them does not recompile)
    scalars,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    FLAGS: tl.constexpr,  # the loss options' code paths (options.LossFlags: HAS_WEIGHT, HAS_SMOOTHING, ...)
    HAS_BIAS: tl.constexpr,
    COMPUTE_STATS: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,             # "ieee" (fp32 FMA) or "tf32" for fp32 inputs
    UPCAST: tl.constexpr = False,            # interpreter only (tile_math.logits_tile)
    ROUND_BF16: tl.constexpr = False,        # unused: the logits tile stays fp32 (the launcher's shared meta)
    COMPUTE_TOKEN_STATS: tl.constexpr = False,
):
    rows, in_rows = tile_rows(tl.program_id(0) * BLOCK_N, n_rows, BLOCK_N)
    target, is_valid, in_range, w_t = tile_targets(target_ptr, rows, in_rows, stride_target, class_weight_ptr,
                                                   n_cols, scalars, FLAGS, BLOCK_N)
    n_scan = tl.where(tl.max(is_valid.to(tl.int32), axis=0) > 0, n_cols, 0)   # all ignored: no work

    m = tl.full((BLOCK_N,), -float("inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    zsum = tl.zeros((BLOCK_N,), tl.float32)
    z_t = tl.zeros((BLOCK_N,), tl.float32)
    best = tl.full((BLOCK_N,), -float("inf"), tl.float32)
    best_idx = tl.zeros((BLOCK_N,), tl.int32)
    q = tl.zeros((BLOCK_N,), tl.float32)
    z_all = tl.zeros((BLOCK_N,), tl.float32)
    z_best = tl.full((BLOCK_N,), -float("inf"), tl.float32)
    z_best_idx = tl.zeros((BLOCK_N,), tl.int32)
    for v0 in range(0, n_scan, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < n_cols
        x = logits_tile(hidden_ptr, weight_ptr, bias_ptr, rows, is_valid, cols, col_mask, n_hidden,
                        stride_hidden, stride_weight, BLOCK_N, BLOCK_V, BLOCK_H, HAS_BIAS, DOT_PRECISION,
                        UPCAST)
        z = logit_transform(x, scalars, FLAGS)
        z = tl.where(col_mask[None, :], z, -float("inf"))
        if FLAGS.HAS_SMOOTHING:
            zc = tl.where(col_mask[None, :], z, 0.0)
            if FLAGS.HAS_WEIGHT:
                zc = zc * tl.load(class_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            zsum += tl.sum(zc, axis=1)
        z_t += tl.sum(tl.where(cols[None, :] == target[:, None], z, 0.0), axis=1)
        m_new, shift = softmax_shift(m, z, 1)   # an all -inf tile adds exactly 0
        e = tl.exp(z - shift[:, None])
        if COMPUTE_ENTROPY:
            t = entropy_rebase(m, s, t, shift) + tl.sum(entropy_terms(e, z, shift[:, None]), axis=1)
        if COMPUTE_TOKEN_STATS:
            rebase = tl.exp(m - shift)
            q = q * rebase * rebase + tl.sum(e * e, axis=1)
            z_all += tl.sum(tl.where(col_mask[None, :], z, 0.0), axis=1)
            z_best, z_best_idx = running_argmax(z_best, z_best_idx, z, v0, 1)
        s = s * tl.exp(m - shift) + tl.sum(e, axis=1)
        m = m_new
        if COMPUTE_STATS:
            best, best_idx = running_argmax(best, best_idx, tl.where(col_mask[None, :], x, -float("inf")), v0, 1)

    lse, lse_lo = row_lse(m, s, is_valid)
    z_t = tl.where(is_valid & in_range, z_t, 0.0)
    loss = row_loss(lse, lse_lo, zsum, z_t, is_valid, in_range, w_t, weight_sum_ptr, n_cols, scalars, FLAGS)
    tl.store(loss_ptr + rows, loss, mask=in_rows)
    tl.store(lse_ptr + rows, lse, mask=in_rows)
    tl.store(lse_lo_ptr + rows, lse_lo, mask=in_rows)
    tl.store(target_logit_ptr + rows, z_t, mask=in_rows)
    if COMPUTE_STATS:
        tl.store(predicted_ptr + rows, tl.where(is_valid, best_idx.to(tl.int64), -1), mask=in_rows)
    if COMPUTE_ENTROPY:
        tl.store(entropy_ptr + rows, entropy_of(s, t, is_valid), mask=in_rows)
    if COMPUTE_TOKEN_STATS:
        log_sum_sq = tl.log(tl.where(is_valid, q, 1.0)) - 2.0 * tl.log(tl.where(is_valid, s, 1.0))
        tl.store(log_sum_sq_ptr + rows, tl.where(is_valid, log_sum_sq, 0.0), mask=in_rows)
        tl.store(mean_ptr + rows, tl.where(is_valid, z_all / n_cols, 0.0), mask=in_rows)
        tl.store(is_top1_ptr + rows, (is_valid & (z_best_idx.to(tl.int64) == target)).to(tl.uint8), mask=in_rows)
