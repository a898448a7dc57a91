"""Test-only device helpers: used only under the Triton interpreter (``TRITON_INTERPRET=1``, the CPU tests), behind the
one switch ``ROUND_BF16`` that the launchers set only there (``launch.INTERPRETED``)."""
import triton
import triton.language as tl


@triton.jit
def to_bf16_rne(x):
    """fp32 ``x`` -> bf16, rounded to nearest (ties to even); NaN stays NaN, subnormals are kept."""
    bits = x.to(tl.uint32, bitcast=True)
    high = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    high = tl.where(x != x, 0x7FC0, high)            # a quiet NaN, whatever the payload did
    return high.to(tl.uint16).to(tl.bfloat16, bitcast=True)
