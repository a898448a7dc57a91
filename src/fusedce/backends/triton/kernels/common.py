"""Device helpers shared by the cross-entropy kernels."""
import triton
import triton.language as tl


@triton.jit
def aligned(n, ALIGN: tl.constexpr):
    """``n`` (a multiple of ``ALIGN``, as the launcher guarantees), written so that the compiler can prove it."""
    if ALIGN > 1:
        n = n // ALIGN * ALIGN
    return n


@triton.jit
def tanh_fp32(y):
    """``tanh(y)`` in fp32, within about 2 ulp of the exact value for every finite ``y`` (and +-1 at +-inf)."""
    a = tl.abs(y)
    u = y * y
    p = -0.003164674388244748
    p = p * u + 0.018629277125000954
    p = p * u - 0.05317629873752594
    p = p * u + 0.13324938714504242
    p = p * u - 0.33333030343055725
    small = y + y * u * p
    big = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    big = tl.where(y < 0.0, -big, big)
    return tl.where(a < 0.55, small, big)


@triton.jit
def two_sum(a, b):
    """``(s, e)``, ``s = fl(a + b)``, ``s + e = a + b`` exactly (Knuth's TwoSum, TAOCP 4.2.2); no FMA can change it."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


@triton.jit
def target_terms(target, n_cols, weight_ptr, scalars, FLAGS: tl.constexpr, col_start=0):
    """``(is_valid, in_range, safe_target, w_t)`` of int64 targets; from ``col_start``: a vocabulary slice's local
    indices."""
    is_valid = target != scalars.ignore_index
    local = target - col_start
    in_range = (local >= 0) & (local < n_cols)
    safe = tl.where(in_range, local, 0)
    if FLAGS.HAS_WEIGHT:
        w_t = tl.load(weight_ptr + safe).to(tl.float32)
    else:
        w_t = 1.0
    return is_valid, in_range, safe, w_t


@triton.jit
def softmax_shift(m, z, AXIS: tl.constexpr):
    """``(m_new, shift)`` of one online-softmax step along AXIS (Milakov & Gimelshein 2018); ``shift`` is 0 while
    ``m_new`` is -inf, so such a block adds exactly 0, not NaN."""
    m_new = tl.maximum(m, tl.max(z, axis=AXIS))
    return m_new, tl.where(m_new == -float("inf"), 0.0, m_new)


@triton.jit
def running_argmax(best, best_idx, x, start, AXIS: tl.constexpr):
    """``(best, best_idx)`` updated with the block ``x`` from column ``start`` along AXIS (lowest index on ties)."""
    bmax, bidx = tl.max(x, axis=AXIS, return_indices=True, return_indices_tie_break_left=True)
    take = bmax > best
    best_idx = tl.where(take, start + bidx, best_idx)
    return tl.where(take, bmax, best), best_idx


@triton.jit
def tile_rows(n0, n_rows, BLOCK_N: tl.constexpr):
    """``(rows, in_rows)`` of a tile of BLOCK_N rows from ``n0``: int64 indices and which are < ``n_rows``."""
    rows = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    return rows, rows < n_rows
