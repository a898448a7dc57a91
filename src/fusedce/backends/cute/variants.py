"""The CuTe kernel variants: one ``KernelKey`` names one compiled kernel (kind, logits dtype, vector
width, constexpr flags). Pure Python, no ``cutlass`` import: the launcher, the compile checks and
``fusedce inspect`` all build their keys here."""
from __future__ import annotations

from typing import NamedTuple, Tuple

from .tuning import ONCHIP_CLUSTERS     # CTAs per row of the on-chip chunk kernel

# The constexpr flags of each kernel, in its constructor's order.
FLAGS = {
    "forward": ("weight", "smoothing", "softcap", "stats"),
    "backward": ("weight", "smoothing", "softcap", "grad_lse"),
    "chunk": ("weight", "smoothing", "softcap", "stats", "zloss", "dft"),
    "onchip": ("weight", "smoothing", "softcap", "stats", "zloss", "dft"),   # the chunk, row kept on chip
}
KINDS = tuple(FLAGS)
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
ARCHS = ("sm_90a", "sm_100a")


class KernelKey(NamedTuple):
    kind: str                 # forward / backward / chunk / onchip
    dtype: str                # logits (and gradient) dtype: fp32 / bf16 / fp16
    vec: int                  # logits per vector access; divides V, the row stride(s) and the pointer
    flags: Tuple[bool, ...]   # FLAGS[kind], in order
    cluster: int = 1          # onchip: CTAs per row (a thread-block cluster when > 1)

    @property
    def name(self) -> str:
        on = [f for f, b in zip(FLAGS[self.kind], self.flags) if b]
        return ("+".join(on) or "plain") + (f" x{self.cluster}" if self.cluster > 1 else "")


def full_vec(dtype: str) -> int:
    """Logits per 128-bit access."""
    return 16 // ITEMSIZE[dtype]


def every_flag_combination(kind: str):
    n = len(FLAGS[kind])
    return [tuple(bool(bits >> i & 1) for i in range(n)) for bits in range(1 << n)]


ROW_KINDS = ("forward", "backward", "chunk")    # the row-streaming kernels, every vector width


def quick_keys():
    """The subset the default test suite compiles per arch: per row-streaming kernel plain, each flag
    alone and all flags in bf16 with 128-bit vectors, plus plain and all-flags in fp32, fp16 and scalar
    bf16; the on-chip chunk kernel with all flags, alone on its CTA and on a cluster of 8 (bf16).
    ``check_keys`` (``make test-cute``) compiles every flag combination."""
    keys = []
    for kind in ROW_KINDS:
        n = len(FLAGS[kind])
        for flags in [(False,) * n] + [tuple(i == j for j in range(n)) for i in range(n)] + [(True,) * n]:
            keys.append(KernelKey(kind, "bf16", full_vec("bf16"), flags))
        for flags in ((False,) * n, (True,) * n):
            keys.append(KernelKey(kind, "fp32", full_vec("fp32"), flags))
            keys.append(KernelKey(kind, "fp16", full_vec("fp16"), flags))
            keys.append(KernelKey(kind, "bf16", 1, flags))
    n = len(FLAGS["onchip"])
    keys += [KernelKey("onchip", "bf16", full_vec("bf16"), (True,) * n, c) for c in (1, 8)]
    return keys


def onchip_keys():
    """The on-chip chunk kernel's variants (128-bit vectors only: its ``cp.async`` copies are 16 bytes):
    plain, each flag alone and all flags in bf16 on one CTA; plain and all flags in bf16 on clusters of
    2, 4 and 8; plain and all flags in fp32 and fp16 on one CTA and all flags on a cluster of 8."""
    n = len(FLAGS["onchip"])
    plain, every = (False,) * n, (True,) * n
    keys = [KernelKey("onchip", "bf16", full_vec("bf16"), f)
            for f in [plain] + [tuple(i == j for j in range(n)) for i in range(n)] + [every]]
    keys += [KernelKey("onchip", "bf16", full_vec("bf16"), f, c) for c in ONCHIP_CLUSTERS[1:] for f in (plain, every)]
    for dtype in ("fp32", "fp16"):
        keys += [KernelKey("onchip", dtype, full_vec(dtype), plain), KernelKey("onchip", dtype, full_vec(dtype), every),
                 KernelKey("onchip", dtype, full_vec(dtype), every, ONCHIP_CLUSTERS[-1])]
    return keys


def check_keys():
    """The variants every CPU compile check builds, per arch: every flag combination of every
    row-streaming kernel in bf16 with 128-bit vectors (16 + 16 + 64), plus plain and all-flags in fp32
    and fp16 at full width and in bf16 at the scalar width (vec = 1: odd V such as GPT-2's 50257); then
    ``onchip_keys``."""
    keys = []
    for kind in ROW_KINDS:
        for flags in every_flag_combination(kind):
            keys.append(KernelKey(kind, "bf16", full_vec("bf16"), flags))
        n = len(FLAGS[kind])
        for flags in ((False,) * n, (True,) * n):
            keys.append(KernelKey(kind, "fp32", full_vec("fp32"), flags))
            keys.append(KernelKey(kind, "fp16", full_vec("fp16"), flags))
            keys.append(KernelKey(kind, "bf16", 1, flags))
    return keys + onchip_keys()
