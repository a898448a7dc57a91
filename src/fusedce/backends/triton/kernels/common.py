"""Device helpers shared by the cross-entropy kernels."""
import triton
import triton.language as tl


@triton.jit
def aligned(n, ALIGN: tl.constexpr):
    """``n`` (a runtime int the launcher guarantees to be a multiple of ``ALIGN``), written so that the
    compiler can prove it.

    Triton specializes an int argument only on divisibility by 16. A bf16 row of V = 16k + 8 elements
    (e.g. a vocabulary shard of 1000) is still 16-byte aligned, but without this the compiler assumes
    divisibility 1 and emits one 16-bit load per element instead of 128-bit loads. ``n // A * A`` is a
    shift pair the compiler folds into its alignment analysis (``tl.multiple_of`` on a scalar argument
    is ignored).
    """
    if ALIGN > 1:
        n = n // ALIGN * ALIGN
    return n


@triton.jit
def to_bf16_rne(x):
    """fp32 ``x`` -> bf16, rounded to nearest (ties to even); NaN stays NaN, subnormals are kept.

    Only for the Triton interpreter, whose fp32 -> bf16 cast truncates (rounds toward zero) where every
    GPU rounds to nearest: with it, CPU tests see the gradients a GPU writes (truncation's bias put a
    bf16 gradient ~60x further from float64 than round-to-nearest, in Frobenius norm, at V = 32001).
    Integer trick on the fp32 bits: add 0x7FFF plus the lowest kept bit, keep the high 16 bits, and
    reinterpret them as bf16 (no float cast involved).
    """
    bits = x.to(tl.uint32, bitcast=True)
    high = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    high = tl.where(x != x, 0x7FC0, high)            # a quiet NaN, whatever the payload did
    return high.to(tl.uint16).to(tl.bfloat16, bitcast=True)


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
    """dz/dx of ``z = softcap * tanh(x / softcap)``, written with z: ``1 - (z / softcap)**2``.

    One ``return``: Triton's code generator checks that every return statement of a function has the
    same type, even one under a constexpr ``if`` (two returns, a block and a scalar, fail to compile for
    a GPU although the interpreter runs them).
    """
    slope = 1.0
    if HAS_SOFTCAP:
        r = z / softcap
        slope = 1.0 - r * r
    return slope


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
