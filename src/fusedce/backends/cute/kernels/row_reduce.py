"""The merges of the CuTe kernels' per-thread row states (``row_math.py`` forms them): online-softmax states and argmax
pairs, across a warp (butterfly shuffles) and across the warps of a CTA (one shared memory slot per warp)."""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

NEG_INF = -math.inf


@cute.jit
def safe_shift(m: Float32) -> Float32:
    """The online-softmax shift: ``m``, or 0 while every logit so far is -inf (exp(-inf - -inf) would be
    NaN; exp(-inf - 0) = 0 keeps the sum at exactly 0)."""
    shift = m
    if m == Float32(NEG_INF):
        shift = Float32(0.0)
    return shift


@cute.jit
def merge_softmax(m: Float32, s: Float32, m2: Float32, s2: Float32):
    """Merge two online-softmax states ``(max, sum exp(z - max))`` (Milakov & Gimelshein 2018)."""
    m_new = cute.arch.fmax(m, m2)
    shift = safe_shift(m_new)
    s_new = s * cute.math.exp(m - shift) + s2 * cute.math.exp(m2 - shift)
    return m_new, s_new


@cute.jit
def merge_argmax(best: Float32, idx: Int32, best2: Float32, idx2: Int32):
    """The larger of two (value, column) pairs, the lowest column on ties."""
    take = best2 > best or (best2 == best and idx2 < idx)
    out_b, out_i = best, idx
    if take:
        out_b, out_i = best2, idx2
    return out_b, out_i


@cute.jit
def block_merge(m: Float32, s: Float32, zsum: Float32, best: Float32, idx: Int32, sbuf_f: cute.Tensor,
                sbuf_i: cute.Tensor, NWARPS: cutlass.Constexpr[int], FLAGS: cutlass.Constexpr,
                COMPUTE_STATS: cutlass.Constexpr[bool]):
    """Merge every thread's row state; every thread gets the CTA's result. ``sbuf_f``: (4, NWARPS) fp32 shared memory,
    ``sbuf_i``: (NWARPS,) int32."""
    offset = 16
    for _ in cutlass.range_constexpr(5):      # butterfly over the warp: 16, 8, 4, 2, 1
        m2 = cute.arch.shuffle_sync_bfly(m, offset=offset)
        s2 = cute.arch.shuffle_sync_bfly(s, offset=offset)
        m, s = merge_softmax(m, s, m2, s2)
        if const_expr(FLAGS.HAS_SMOOTHING):
            zsum = zsum + cute.arch.shuffle_sync_bfly(zsum, offset=offset)
        if const_expr(COMPUTE_STATS):
            b2 = cute.arch.shuffle_sync_bfly(best, offset=offset)
            i2 = cute.arch.shuffle_sync_bfly(idx, offset=offset)
            best, idx = merge_argmax(best, idx, b2, i2)
        offset = offset // 2
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    if lane == 0:
        sbuf_f[0, warp] = m
        sbuf_f[1, warp] = s
        sbuf_f[2, warp] = zsum
        sbuf_f[3, warp] = best
        sbuf_i[warp] = idx
    cute.arch.barrier()
    m, s, zsum, best, idx = sbuf_f[0, 0], sbuf_f[1, 0], sbuf_f[2, 0], sbuf_f[3, 0], sbuf_i[0]
    for w in cutlass.range_constexpr(1, NWARPS):
        m, s = merge_softmax(m, s, sbuf_f[0, w], sbuf_f[1, w])
        if const_expr(FLAGS.HAS_SMOOTHING):
            zsum = zsum + sbuf_f[2, w]
        if const_expr(COMPUTE_STATS):
            best, idx = merge_argmax(best, idx, sbuf_f[3, w], sbuf_i[w])
    return m, s, zsum, best, idx
