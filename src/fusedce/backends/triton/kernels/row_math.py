"""The per-row cross-entropy math of the Triton kernels, written once (formulas and sources:
``fusedce/core/row_math.py``), and the loss options' element-wise math."""
import triton
import triton.language as tl

from .common import running_argmax, softmax_shift, tanh_fp32, two_sum
from .interpreter import to_bf16_rne


@triton.jit
def logit_transform(x, scalars, FLAGS: tl.constexpr):
    """``softcap * tanh(logit_scale * x / softcap)`` (Gemma 2 soft-capping, Cohere's ``logit_scale``), or
    ``logit_scale * x``; a few ulp of relative error (``tanh_fp32``)."""
    if FLAGS.HAS_SOFTCAP:
        c = scalars.softcap
        x = c * tanh_fp32(x * (scalars.logit_scale / c))   # one multiply per logit
    else:
        x = x * scalars.logit_scale
    return x


@triton.jit
def logit_slope(z, scalars, FLAGS: tl.constexpr):
    """dz/dx of ``logit_transform``, written with z: ``logit_scale * (1 - (z / softcap)**2)``, or ``logit_scale``."""
    slope = scalars.logit_scale
    if FLAGS.HAS_SOFTCAP:
        r = z / scalars.softcap
        slope = scalars.logit_scale * (1.0 - r * r)
    return slope


@triton.jit
def z_block(row_ptr, cols, mask, scalars, FLAGS: tl.constexpr):
    """``(x, z)`` of one block of a row at ``cols``: raw fp32 logits and ``logit_transform(x)``, -inf off ``mask``."""
    x = tl.load(row_ptr + cols, mask=mask, other=-float("inf")).to(tl.float32)
    z = logit_transform(x, scalars, FLAGS)
    # Padded columns load as -inf; a transform that maps -inf to a finite value (softcap) must send them back.
    # Only such options' flags belong here: an unconditional select costs registers.
    if FLAGS.HAS_SOFTCAP:
        z = tl.where(mask, z, -float("inf"))
    return x, z


@triton.jit
def row_stats(row_ptr, n_cols, n_scan, weight_ptr, scalars, FLAGS: tl.constexpr,
              BLOCK_V: tl.constexpr, COMPUTE_STATS: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr):
    """One pass over a row's first ``n_scan`` logits: ``(m, s, zsum, best, best_idx, t)``, the online softmax
    (Milakov & Gimelshein 2018), the smoothing sum, the argmax and (COMPUTE_ENTROPY) the entropy sum."""
    m = -float("inf")
    s = 0.0
    t = 0.0
    zsum = 0.0
    best = -float("inf")
    best_idx = 0
    for start in range(0, n_scan, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        x, z = z_block(row_ptr, cols, mask, scalars, FLAGS)
        if FLAGS.HAS_SMOOTHING:
            if FLAGS.HAS_WEIGHT:
                w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                zsum += tl.sum(w * tl.where(mask, z, 0.0), axis=0)
            else:
                zsum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        m_new, shift = softmax_shift(m, z, 0)   # a block of -inf logits adds exactly 0
        if COMPUTE_ENTROPY:   # (the compiler shares exp(z - shift) with the line below)
            t = entropy_rebase(m, s, t, shift) + tl.sum(entropy_terms(tl.exp(z - shift), z, shift), axis=0)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        m = m_new
        if COMPUTE_STATS:
            best, best_idx = running_argmax(best, best_idx, x, start, 0)
    return m, s, zsum, best, best_idx, t


@triton.jit
def entropy_rebase(m, s, t, shift):
    """The online entropy sum ``t = sum_c exp(z_c - m) (z_c - m)`` re-based from ``m`` to ``shift``."""
    d = tl.where(m == -float("inf"), 0.0, m - shift)
    return tl.where(m == -float("inf"), 0.0, tl.exp(d) * (t + d * s))


@triton.jit
def entropy_terms(e, z, shift):
    """``exp(z - shift) (z - shift)`` per logit, 0 where ``z = -inf`` (not ``0 * -inf``)."""
    return tl.where(z == -float("inf"), 0.0, e * (z - shift))


@triton.jit
def entropy_of(s, t, is_valid):
    """``-sum_c p_c log p_c = log s - t / s`` from the shifted sums (0 on ignored rows)."""
    return tl.where(is_valid, tl.log(tl.where(is_valid, s, 1.0)) - t / tl.where(is_valid, s, 1.0), 0.0)


@triton.jit
def row_forward(row_ptr, n_cols, is_valid, in_range, safe, w_t, weight_ptr, weight_sum_ptr,
                scalars, FLAGS: tl.constexpr, BLOCK_V: tl.constexpr, COMPUTE_STATS: tl.constexpr,
                COMPUTE_ENTROPY: tl.constexpr):
    """``(loss, lse, lse_lo, argmax, z_t, entropy)`` of one row (fp32 scalars; argmax int; entropy 0.0 without
    COMPUTE_ENTROPY)."""
    m, s, zsum, best, best_idx, t = row_stats(row_ptr, n_cols, tl.where(is_valid, n_cols, 0), weight_ptr,
                                              scalars, FLAGS, BLOCK_V, COMPUTE_STATS, COMPUTE_ENTROPY)
    lse, lse_lo = row_lse(m, s, is_valid)
    z_t = logit_transform(tl.load(row_ptr + safe).to(tl.float32), scalars, FLAGS)
    loss = row_loss(lse, lse_lo, zsum, z_t, is_valid, in_range, w_t, weight_sum_ptr, n_cols, scalars, FLAGS)
    entropy = 0.0
    if COMPUTE_ENTROPY:
        entropy = entropy_of(s, t, is_valid)
    return loss, lse, lse_lo, best_idx, z_t, entropy


@triton.jit
def row_lse(m, s, is_valid):
    """``(lse, lse_lo)`` from a row's online max and sum-exp; 0 on ignored rows (nothing scanned)."""
    return two_sum(tl.where(is_valid, m, 0.0), tl.log(tl.where(is_valid, s, 1.0)))


@triton.jit
def row_loss(lse, lse_lo, zsum, z_t, is_valid, in_range, w_t, weight_sum_ptr, n_cols, scalars, FLAGS: tl.constexpr):
    """The row's cross-entropy without z-loss: the one loss formula of the kernels; 0 on ignored rows, NaN
    on a kept row whose target is out of range."""
    # nll = lse - z_t with lse's rounding error added back (as accurate as -log_softmax[t])
    eps = scalars.label_smoothing
    loss = (1.0 - eps) * w_t * ((lse - z_t) + lse_lo)
    if FLAGS.HAS_SMOOTHING:
        total_w = total_weight(weight_sum_ptr, n_cols, FLAGS)
        loss += eps / n_cols * ((total_w * lse - zsum) + total_w * lse_lo)
    loss = tl.where(in_range, loss, float("nan"))
    loss = tl.where(is_valid, loss, 0.0)
    return loss


@triton.jit
def total_weight(weight_sum_ptr, n_cols, FLAGS: tl.constexpr):
    """``W = sum_c w_c``: the saved class-weight sum (FLAGS.HAS_WEIGHT), or V without class weights."""
    total = n_cols * 1.0
    if FLAGS.HAS_WEIGHT:
        total = tl.load(weight_sum_ptr)
    return total


@triton.jit
def grad_block(x, cols, mask, target, w_t, lse, lse_lo, g, h, weight_ptr, weight_sum_ptr, n_cols,
               scalars, FLAGS: tl.constexpr, HAS_GRAD_LSE: tl.constexpr, k=0.0, entropy=0.0,
               HAS_GRAD_ENTROPY: tl.constexpr = False):
    """fp32 ``dL/dx`` of a block of one row; ``h`` read with HAS_GRAD_LSE, ``k`` and ``entropy`` with
    HAS_GRAD_ENTROPY."""
    z = logit_transform(x, scalars, FLAGS)
    p = tl.exp((z - lse) - lse_lo)   # z - lse is exact near the max (Sterbenz); lse_lo adds lse's error back
    p_minus_onehot = p - tl.where(cols == target, 1.0, 0.0)
    eps = scalars.label_smoothing
    a = (1.0 - eps) * w_t
    if FLAGS.HAS_SMOOTHING:
        if FLAGS.HAS_WEIGHT:
            w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            w = 1.0
        total_w = total_weight(weight_sum_ptr, n_cols, FLAGS)
        dz = g * (a * p_minus_onehot + eps / n_cols * (total_w * p - w))
    else:
        dz = (g * a) * p_minus_onehot
    if HAS_GRAD_LSE:
        dz += h * p
    if HAS_GRAD_ENTROPY:
        dz -= k * tl.where(p == 0.0, 0.0, p * (((z - lse) - lse_lo) + entropy))
    return dz * logit_slope(z, scalars, FLAGS)


@triton.jit
def store_grad(ptr, dz, mask, ROUND_BF16: tl.constexpr):
    """Store fp32 ``dz`` in ``ptr``'s dtype; ROUND_BF16 (interpreter only) rounds to nearest as GPUs do."""
    if ROUND_BF16:
        tl.store(ptr, to_bf16_rne(dz), mask=mask)
    else:
        tl.store(ptr, dz.to(ptr.dtype.element_ty), mask=mask)
