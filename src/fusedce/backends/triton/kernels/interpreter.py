"""Test-only device helpers: used only under the Triton interpreter (``TRITON_INTERPRET=1``, the CPU tests),
behind the one switch ``ROUND_BF16`` that the launchers set only there (``launch.INTERPRETED``). A GPU
launch never compiles them in."""
import triton
import triton.language as tl


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
