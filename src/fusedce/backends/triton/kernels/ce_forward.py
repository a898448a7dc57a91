"""Cross-entropy forward: one program per row, online softmax over vocabulary blocks.

Per row (see ``backends/reference/rows.py`` for the formula and its sources) it writes the fp32
cross-entropy loss (without the z-loss, which the caller adds from ``lse``), the fp32 lse as a pair
``lse + lse_lo`` (``lse_lo`` is the rounding error of ``lse = max + log(sum)``, kept so that the
backward's softmax is as accurate as PyTorch's ``exp((z - max) - log(sum))``) and, with COMPUTE_STATS,
the argmax of the raw logits. Ignored rows are not read at all: loss, lse and lse_lo 0, argmax -1.

Bytes moved per token (row), V classes, s bytes per logit:
    read  V * s (logits, once; skipped entirely on ignored rows)
          + 4-8 (target) + 4 (w_t) [+ 4 V class weights, L2-resident, when smoothing with weights]
    write 4 (loss) + 4 (lse) + 4 (lse_lo) [+ 8 (argmax) with stats]
Nothing of size BT x V is written: a forward-only call reads the logits once.
"""
import triton
import triton.language as tl

from .common import aligned, logit_transform, target_terms, two_sum


@triton.jit
def ce_forward_kernel(
    # pointers
    logits_ptr,       # [n_rows, n_cols] fp32/bf16/fp16, last dim contiguous
    target_ptr,       # [n_rows] int32/int64
    weight_ptr,       # [n_cols] float class weights (read only if HAS_WEIGHT)
    weight_sum_ptr,   # [1] fp32, sum of the class weights (read only if HAS_WEIGHT and HAS_SMOOTHING)
    loss_ptr,         # [n_rows] fp32 out
    lse_ptr,          # [n_rows] fp32 out
    lse_lo_ptr,       # [n_rows] fp32 out: lse's rounding error (lse + lse_lo = max + log(sum) exactly)
    predicted_ptr,    # [n_rows] int64 out (written only if COMPUTE_STATS)
    # sizes
    n_cols,
    # strides (elements)
    stride_logits_row, stride_target,
    # runtime scalars (fp32; changing them does not recompile)
    ignore_index, label_smoothing, softcap, logit_scale,
    # meta-parameters
    BLOCK_V: tl.constexpr,
    ALIGN: tl.constexpr,  # n_cols and stride_logits_row are multiples of ALIGN (see common.aligned)
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    COMPUTE_STATS: tl.constexpr,
):
    n_cols = aligned(n_cols, ALIGN)
    stride_logits_row = aligned(stride_logits_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits_row
    target = tl.load(target_ptr + row * stride_target).to(tl.int64)
    is_valid, in_range, safe, w_t = target_terms(target, n_cols, ignore_index, weight_ptr, HAS_WEIGHT)

    # Online softmax (Milakov & Gimelshein 2018): running max m and s = sum exp(z - m).
    # Ignored rows run zero iterations.
    n_scan = tl.where(is_valid, n_cols, 0)
    m = -float("inf")
    s = 0.0
    zsum = 0.0                 # sum_c w_c z_c (w = 1 without weights), for smoothing only
    best = -float("inf")       # running argmax of the raw logits (lowest index on ties)
    best_idx = 0
    for start in range(0, n_scan, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        x = tl.load(row_ptr + cols, mask=mask, other=-float("inf")).to(tl.float32)
        z = logit_transform(x, logit_scale, softcap, HAS_SOFTCAP)
        if HAS_SOFTCAP:
            z = tl.where(mask, z, -float("inf"))
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                zsum += tl.sum(w * tl.where(mask, z, 0.0), axis=0)
            else:
                zsum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # While every logit so far is -inf (a masked block), shift by 0 instead of m_new = -inf:
        # exp(-inf - -inf) would be NaN; exp(-inf - 0) = 0 keeps s = 0.
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        m = m_new
        if COMPUTE_STATS:
            bmax, bidx = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            take = bmax > best
            best_idx = tl.where(take, start + bidx, best_idx)
            best = tl.where(take, bmax, best)
    # skipped (ignored) rows have m = -inf, s = 0: give them lse = lse_lo = 0 without forming -inf - -inf
    lse, lse_lo = two_sum(tl.where(is_valid, m, 0.0), tl.log(tl.where(is_valid, s, 1.0)))

    x_t = tl.load(row_ptr + safe).to(tl.float32)
    z_t = logit_transform(x_t, logit_scale, softcap, HAS_SOFTCAP)
    # nll = lse - z_t with lse's rounding error added back (as accurate as -log_softmax[t])
    loss = (1.0 - label_smoothing) * w_t * ((lse - z_t) + lse_lo)
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            total_w = tl.load(weight_sum_ptr)
        else:
            total_w = n_cols * 1.0
        loss += label_smoothing / n_cols * ((total_w * lse - zsum) + total_w * lse_lo)
    loss = tl.where(in_range, loss, float("nan"))
    loss = tl.where(is_valid, loss, 0.0)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)
    tl.store(lse_lo_ptr + row, lse_lo)
    if COMPUTE_STATS:
        tl.store(predicted_ptr + row, tl.where(is_valid, best_idx.to(tl.int64), -1))
