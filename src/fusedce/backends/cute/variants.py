"""The CuTe kernel variants: one ``KernelKey`` names one compiled kernel (kind, logits dtype, vector
width, constexpr flags). Pure Python, no ``cutlass`` import: the launcher, the compile checks and
``fusedce inspect`` all build their keys here."""
from __future__ import annotations

from typing import NamedTuple, Tuple

# The constexpr flags of each kernel, in its constructor's order.
FLAGS = {
    "forward": ("weight", "smoothing", "softcap", "stats"),
    "backward": ("weight", "smoothing", "softcap", "grad_lse"),
    "chunk": ("weight", "smoothing", "softcap", "stats", "zloss", "dft"),
}
KINDS = tuple(FLAGS)
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
ARCHS = ("sm_90a", "sm_100a")


class KernelKey(NamedTuple):
    kind: str                 # forward / backward / chunk
    dtype: str                # logits (and gradient) dtype: fp32 / bf16 / fp16
    vec: int                  # logits per vector access; divides V, the row stride(s) and the pointer
    flags: Tuple[bool, ...]   # FLAGS[kind], in order

    @property
    def name(self) -> str:
        on = [f for f, b in zip(FLAGS[self.kind], self.flags) if b]
        return "+".join(on) or "plain"


def full_vec(dtype: str) -> int:
    """Logits per 128-bit access."""
    return 16 // ITEMSIZE[dtype]


def every_flag_combination(kind: str):
    n = len(FLAGS[kind])
    return [tuple(bool(bits >> i & 1) for i in range(n)) for bits in range(1 << n)]


def quick_keys():
    """The subset the default test suite compiles per arch (~20 s): per kernel plain, each flag alone
    and all flags in bf16 with 128-bit vectors, plus plain and all-flags in fp32, fp16 and scalar bf16.
    ``check_keys`` (``make test-cute``) compiles every flag combination."""
    keys = []
    for kind in KINDS:
        n = len(FLAGS[kind])
        for flags in [(False,) * n] + [tuple(i == j for j in range(n)) for i in range(n)] + [(True,) * n]:
            keys.append(KernelKey(kind, "bf16", full_vec("bf16"), flags))
        for flags in ((False,) * n, (True,) * n):
            keys.append(KernelKey(kind, "fp32", full_vec("fp32"), flags))
            keys.append(KernelKey(kind, "fp16", full_vec("fp16"), flags))
            keys.append(KernelKey(kind, "bf16", 1, flags))
    return keys


def check_keys():
    """The variants every CPU compile check builds, per arch: every flag combination of every kernel
    in bf16 with 128-bit vectors (16 + 16 + 64), plus plain and all-flags in fp32 and fp16 at full
    width and in bf16 at the scalar width (vec = 1: odd V such as GPT-2's 50257)."""
    keys = []
    for kind in KINDS:
        for flags in every_flag_combination(kind):
            keys.append(KernelKey(kind, "bf16", full_vec("bf16"), flags))
        n = len(FLAGS[kind])
        for flags in ((False,) * n, (True,) * n):
            keys.append(KernelKey(kind, "fp32", full_vec("fp32"), flags))
            keys.append(KernelKey(kind, "fp16", full_vec("fp16"), flags))
            keys.append(KernelKey(kind, "bf16", 1, flags))
    return keys
