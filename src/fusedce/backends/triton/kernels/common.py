"""Device helpers shared by the cross-entropy kernels."""
import triton
import triton.language as tl


@triton.jit
def apply_softcap(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """``softcap * tanh(x / softcap)`` in fp32 (Gemma 2 logit soft-capping), or ``x``.

    tanh(y) = 1 - 2 / (exp(2y) + 1): saturates exactly to +-1 for large |y| (exp -> inf or 0); its
    absolute error near 0 is ~1 ulp of 1, i.e. ~6e-8 * softcap on the capped logit.
    """
    if HAS_SOFTCAP:
        x = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0))
    return x


@triton.jit
def softcap_slope(z, softcap, HAS_SOFTCAP: tl.constexpr):
    """dz/dx of ``z = softcap * tanh(x / softcap)``, written with z: ``1 - (z / softcap)**2``."""
    if HAS_SOFTCAP:
        r = z / softcap
        return 1.0 - r * r
    return 1.0


@triton.jit
def target_terms(target, n_cols, ignore_index, weight_ptr, HAS_WEIGHT: tl.constexpr):
    """(is_valid, in_range, safe_target, w_t) for one row's int64 target.

    ``safe_target`` is 0 unless the target is a class in [0, V): never index with ``ignore_index`` or a
    bad target (a bad, non-ignored target gives a NaN loss row, not an out-of-bounds read). Loads at
    ``safe_target`` are always in bounds, so they need no mask.
    """
    is_valid = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    safe = tl.where(in_range, target, 0)
    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + safe).to(tl.float32)
    else:
        w_t = 1.0
    return is_valid, in_range, safe, w_t
