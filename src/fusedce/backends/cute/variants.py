"""The CuTe kernel variants: one ``KernelKey`` names one compiled kernel (kind, logits dtype, vector width, constexpr
flags)."""
from __future__ import annotations

from typing import NamedTuple, Tuple

from fusedce.core.options import LossFlags
from .tuning import ONCHIP_CLUSTERS     # CTAs per row of the on-chip chunk kernel

# The feature flags of each kernel that are not loss options, in its constructor's order (after FLAGS).
FEATURES = {
    "forward": ("stats",),
    "backward": ("grad_lse",),
    "chunk": ("stats", "zloss", "dft"),
    "onchip": ("stats", "zloss", "dft"),   # the chunk, row kept on chip
}
KINDS = tuple(FEATURES)
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
ARCHS = ("sm_90a", "sm_100a")
# the loss flags' short names in variant names: HAS_WEIGHT -> "weight"
LOSS_FLAG_NAMES = tuple(f.lower().removeprefix("has_") for f in LossFlags._fields)


class KernelKey(NamedTuple):
    kind: str                 # forward / backward / chunk / onchip
    dtype: str                # logits (and gradient) dtype: fp32 / bf16 / fp16
    vec: int                  # logits per vector access; divides V, the row stride(s) and the pointer
    loss: LossFlags           # the loss options' flags (the kernel's FLAGS argument)
    features: Tuple[bool, ...]  # FEATURES[kind], in order
    cluster: int = 1          # onchip: CTAs per row (a thread-block cluster when > 1)

    @property
    def feature(self) -> dict:
        """``{name: bool}`` of ``features``."""
        return dict(zip(FEATURES[self.kind], self.features))

    @property
    def name(self) -> str:
        on = [f for f, b in zip(LOSS_FLAG_NAMES + FEATURES[self.kind], self.loss + self.features) if b]
        return ("+".join(on) or "plain") + (f" x{self.cluster}" if self.cluster > 1 else "")


def flag_names(kind: str) -> tuple:
    """Every constexpr flag of ``kind``: the loss flags, then the features (``make_key``'s order)."""
    return LOSS_FLAG_NAMES + FEATURES[kind]


def make_key(kind: str, dtype: str, vec: int, bits, cluster: int = 1) -> KernelKey:
    """The key of ``bits``, one bool per ``flag_names(kind)``."""
    bits, n = tuple(bits), len(LossFlags._fields)
    return KernelKey(kind, dtype, vec, LossFlags(*bits[:n]), bits[n:], cluster)


def full_vec(dtype: str) -> int:
    """Logits per 128-bit access."""
    return 16 // ITEMSIZE[dtype]


def every_flag_combination(kind: str):
    n = len(flag_names(kind))
    return [tuple(bool(bits >> i & 1) for i in range(n)) for bits in range(1 << n)]


def _plain_alone_all(kind: str):
    """Plain, each flag alone, every flag."""
    n = len(flag_names(kind))
    return [(False,) * n] + [tuple(i == j for j in range(n)) for i in range(n)] + [(True,) * n]


ROW_KINDS = ("forward", "backward", "chunk")    # the row-streaming kernels, every vector width


def quick_keys():
    """The subset the default test suite compiles per arch: plain, each flag alone and all flags in bf16, plus a
    few fp32 / fp16 / scalar variants and the on-chip kernel."""
    keys = []
    for kind in ROW_KINDS:
        n = len(flag_names(kind))
        for bits in _plain_alone_all(kind):
            keys.append(make_key(kind, "bf16", full_vec("bf16"), bits))
        for bits in ((False,) * n, (True,) * n):
            keys.append(make_key(kind, "fp32", full_vec("fp32"), bits))
            keys.append(make_key(kind, "fp16", full_vec("fp16"), bits))
            keys.append(make_key(kind, "bf16", 1, bits))
    n = len(flag_names("onchip"))
    keys += [make_key("onchip", "bf16", full_vec("bf16"), (True,) * n, c) for c in (1, 8)]
    return keys


def onchip_keys():
    """The on-chip chunk kernel's variants (128-bit vectors only: ``cp.async`` copies 16 bytes), on one CTA and
    on clusters."""
    n = len(flag_names("onchip"))
    plain, every = (False,) * n, (True,) * n
    keys = [make_key("onchip", "bf16", full_vec("bf16"), f) for f in _plain_alone_all("onchip")]
    keys += [make_key("onchip", "bf16", full_vec("bf16"), f, c) for c in ONCHIP_CLUSTERS[1:] for f in (plain, every)]
    for dtype in ("fp32", "fp16"):
        keys += [make_key("onchip", dtype, full_vec(dtype), plain), make_key("onchip", dtype, full_vec(dtype), every),
                 make_key("onchip", dtype, full_vec(dtype), every, ONCHIP_CLUSTERS[-1])]
    return keys


def check_keys():
    """The variants every CPU compile check builds, per arch: every flag combination in bf16 with 128-bit
    vectors, plain and all flags in the other dtypes and widths, then ``onchip_keys``."""
    keys = []
    for kind in ROW_KINDS:
        for bits in every_flag_combination(kind):
            keys.append(make_key(kind, "bf16", full_vec("bf16"), bits))
        n = len(flag_names(kind))
        for bits in ((False,) * n, (True,) * n):
            keys.append(make_key(kind, "fp32", full_vec("fp32"), bits))
            keys.append(make_key(kind, "fp16", full_vec("fp16"), bits))
            keys.append(make_key(kind, "bf16", 1, bits))
    return keys + onchip_keys()
