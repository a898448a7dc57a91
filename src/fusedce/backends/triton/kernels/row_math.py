"""The per-row cross-entropy math of the kernels, written once and shared by ``ce_forward``,
``ce_backward`` and the fused ``ce_chunk`` kernel (see ``backends/pytorch/rows.py`` for the formulas
and their sources; the PyTorch backend computes the same ones).

- ``row_stats``: one pass over a row (or a vocabulary slice of it) in ``BLOCK_V`` blocks, online
  softmax (Milakov & Gimelshein 2018): max, sum-exp, the smoothing sum and the argmax; a block of -inf
  logits adds exactly 0;
- ``row_forward``: ``row_stats`` then the loss (cross-entropy without the z-loss), lse as an exact pair
  ``lse + lse_lo`` (TwoSum), the argmax of the raw logits and the target's ``z_t``.
- ``grad_block``: ``dL/dx`` of one block of a row from the saved lse pair, with ``g`` the upstream
  gradient of the row's loss and ``h`` that of its lse (the z-loss arrives that way):

      dL/dz_c = g (a (p_c - [c == t]) + b (W p_c - w_c)) + h p_c,   p_c = exp((z_c - lse) - lse_lo)

  ``a = (1 - eps) w_t``, ``b = eps / V``, ``W = sum_c w_c``; then ``dz/dx`` (``logit_slope``). The
  differences are formed before scaling, so the gradient is exactly 0 where the math says so.
- ``store_grad``: the gradient in the output's dtype (rounded to nearest; see ``to_bf16_rne``).
"""
import triton
import triton.language as tl

from .common import logit_slope, logit_transform, two_sum
from .interpreter import to_bf16_rne


@triton.jit
def row_stats(row_ptr, n_cols, n_scan, weight_ptr, softcap, logit_scale,
              BLOCK_V: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, COMPUTE_STATS: tl.constexpr):
    """One pass over the first ``n_scan`` (0 or ``n_cols``) logits of a row: ``(m, s, zsum, best,
    best_idx)``, the running max of z and ``s = sum exp(z - m)`` (online softmax, Milakov & Gimelshein
    2018), ``sum_c w_c z_c`` (smoothing only), and the max of the raw logits with its lowest index."""
    m = -float("inf")
    s = 0.0
    zsum = 0.0
    best = -float("inf")
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
        # exp(-inf - -inf) would be NaN; exp(-inf - 0) = 0 keeps s = 0: such a block adds exactly 0.
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        m = m_new
        if COMPUTE_STATS:
            bmax, bidx = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            take = bmax > best
            best_idx = tl.where(take, start + bidx, best_idx)
            best = tl.where(take, bmax, best)
    return m, s, zsum, best, best_idx


@triton.jit
def row_forward(row_ptr, n_cols, is_valid, in_range, safe, w_t, weight_ptr, weight_sum_ptr,
                label_smoothing, softcap, logit_scale,
                BLOCK_V: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, COMPUTE_STATS: tl.constexpr):
    """``(loss, lse, lse_lo, argmax, z_t)`` of one row (fp32 scalars; argmax int). Ignored rows run zero
    iterations and give 0 for loss, lse and lse_lo; a non-ignored row whose target is out of range
    gets a NaN loss."""
    m, s, zsum, best, best_idx = row_stats(row_ptr, n_cols, tl.where(is_valid, n_cols, 0), weight_ptr, softcap,
                                           logit_scale, BLOCK_V, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP,
                                           COMPUTE_STATS)
    # skipped (ignored) rows have m = -inf, s = 0: give them lse = lse_lo = 0 without forming -inf - -inf
    lse, lse_lo = two_sum(tl.where(is_valid, m, 0.0), tl.log(tl.where(is_valid, s, 1.0)))

    z_t = logit_transform(tl.load(row_ptr + safe).to(tl.float32), logit_scale, softcap, HAS_SOFTCAP)
    # nll = lse - z_t with lse's rounding error added back (as accurate as -log_softmax[t])
    loss = (1.0 - label_smoothing) * w_t * ((lse - z_t) + lse_lo)
    if HAS_SMOOTHING:
        total_w = total_weight(weight_sum_ptr, n_cols, HAS_WEIGHT)
        loss += label_smoothing / n_cols * ((total_w * lse - zsum) + total_w * lse_lo)
    loss = tl.where(in_range, loss, float("nan"))
    loss = tl.where(is_valid, loss, 0.0)
    return loss, lse, lse_lo, best_idx, z_t


@triton.jit
def total_weight(weight_sum_ptr, n_cols, HAS_WEIGHT: tl.constexpr):
    """``W = sum_c w_c``: the saved class-weight sum, or V without class weights."""
    total = n_cols * 1.0
    if HAS_WEIGHT:
        total = tl.load(weight_sum_ptr)
    return total


@triton.jit
def grad_block(x, cols, mask, target, w_t, lse, lse_lo, g, h, weight_ptr, weight_sum_ptr, n_cols,
               label_smoothing, softcap, logit_scale,
               HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_GRAD_LSE: tl.constexpr):
    """fp32 ``dL/dx`` of a block ``x`` (fp32 logits at columns ``cols``) of one row; ``h`` is read only
    with HAS_GRAD_LSE. ``target`` is the target's column in this row's columns (outside [0, n) for a
    vocabulary slice that does not hold it) and ``n_cols`` the GLOBAL V of the smoothing term and of W
    without weights. The caller zeroes ignored rows."""
    z = logit_transform(x, logit_scale, softcap, HAS_SOFTCAP)
    p = tl.exp((z - lse) - lse_lo)   # z - lse is exact near the max (Sterbenz); lse_lo adds lse's error back
    p_minus_onehot = p - tl.where(cols == target, 1.0, 0.0)
    a = (1.0 - label_smoothing) * w_t
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            w = 1.0
        total_w = total_weight(weight_sum_ptr, n_cols, HAS_WEIGHT)
        dz = g * (a * p_minus_onehot + label_smoothing / n_cols * (total_w * p - w))
    else:
        dz = (g * a) * p_minus_onehot
    if HAS_GRAD_LSE:
        dz += h * p
    return dz * logit_slope(z, logit_scale, softcap, HAS_SOFTCAP)


@triton.jit
def store_grad(ptr, dz, mask, ROUND_BF16: tl.constexpr):
    """Store fp32 ``dz`` in ``ptr``'s dtype. ROUND_BF16 (interpreter only): round to nearest by hand,
    as GPUs do, where the interpreter's cast truncates (``common.to_bf16_rne``)."""
    if ROUND_BF16:
        tl.store(ptr, to_bf16_rne(dz), mask=mask)
    else:
        tl.store(ptr, dz.to(ptr.dtype.element_ty), mask=mask)
