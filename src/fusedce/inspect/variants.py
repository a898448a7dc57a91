"""What ``fusedce inspect`` compiles: the kernels, their representative constexpr-flag combinations, the
vocabularies and dtypes, and each launch built exactly as the launcher builds it (on meta tensors)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..types import LossOptions

# chunk: the fused loss + gradient of linear_cross_entropy; slice: the partial statistics of a vocabulary
# slice (vocab parallelism; its gradient is the backward kernel with a column offset)
KERNELS = ("forward", "backward", "chunk", "slice", "tiled_forward", "tiled_backward")
TILED = ("tiled_forward", "tiled_backward")   # the no-logits LM head (method="tiled"): V is the head's rows
TILED_HIDDEN = 4096         # H of the tiled kernels (Llama-3-8B); only the H loop's trip count depends on it
ROWS = 8192                 # BT: only the grid depends on it
ARCHS = (90, 100)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# The vocabularies of the issue, then two that exercise the alignment rule.
VOCABS = {
    32000: "Llama-2, Mistral",
    128256: "Llama-3",
    262144: "2^18, Gemma-3 size",
    1000: "TP shard of 32000 / 32: V % 16 == 8",
    50257: "GPT-2: odd, unaligned rows",
}
DEFAULT_VOCABS = (32000, 128256, 262144, 1000, 50257)


@dataclass(frozen=True)
class Variant:
    """Loss options that select the kernels' constexpr flags (HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP,
    COMPUTE_STATS; z-loss selects the backward's HAS_GRAD_LSE: its gradient arrives through the lse)."""

    weight: bool = False
    smoothing: bool = False
    softcap: bool = False
    stats: bool = False
    zloss: bool = False
    dft: bool = False
    entropy: bool = False   # forward: COMPUTE_ENTROPY; backward: HAS_GRAD_ENTROPY (the RL ops)
    bias: bool = False      # tiled kernels: HAS_BIAS

    def options(self) -> LossOptions:
        return LossOptions(-100, 0.1 if self.smoothing else 0.0, 1e-4 if self.zloss else 0.0,
                           30.0 if self.softcap else None, use_token_scaling=self.dft)


# The representative flag combinations shown by default (``--every-variant``: all of them).
VARIANTS = {
    "forward": {
        "plain": Variant(),
        "stats": Variant(stats=True),
        "weight": Variant(weight=True),
        "softcap": Variant(softcap=True),
        "smooth": Variant(smoothing=True),
        "smooth+weight": Variant(weight=True, smoothing=True),
        "all": Variant(weight=True, smoothing=True, softcap=True, stats=True),
        "entropy": Variant(entropy=True),
        "entropy+softcap": Variant(softcap=True, entropy=True),
    },
    "backward": {
        "plain": Variant(),
        "softcap": Variant(softcap=True),
        "smooth+weight": Variant(weight=True, smoothing=True),
        "all": Variant(weight=True, smoothing=True, softcap=True, zloss=True),
        "entropy": Variant(zloss=True, entropy=True),
        "entropy+softcap": Variant(softcap=True, zloss=True, entropy=True),
    },
    "tiled_forward": {
        "plain": Variant(),
        "entropy": Variant(entropy=True),
        "all": Variant(weight=True, smoothing=True, softcap=True, stats=True, entropy=True, bias=True),
    },
    "tiled_backward": {
        "plain": Variant(),
        "entropy": Variant(zloss=True, entropy=True),
        "all": Variant(weight=True, smoothing=True, softcap=True, zloss=True, entropy=True, bias=True),
    },
    "slice": {
        "plain": Variant(),
        "all": Variant(weight=True, smoothing=True, softcap=True),
    },
    "chunk": {
        "plain": Variant(),
        "softcap": Variant(softcap=True),
        "smooth+weight": Variant(weight=True, smoothing=True),
        "all": Variant(weight=True, smoothing=True, softcap=True, stats=True, zloss=True, dft=True),
    },
}
_FLAGS = {"forward": ("weight", "smoothing", "softcap", "stats"),
          "backward": ("weight", "smoothing", "softcap", "zloss"),
          "chunk": ("weight", "smoothing", "softcap", "stats", "zloss", "dft"),
          "slice": ("weight", "smoothing", "softcap"),
          "tiled_forward": ("weight", "smoothing", "softcap", "stats", "entropy", "bias"),
          "tiled_backward": ("weight", "smoothing", "softcap", "zloss", "entropy", "bias")}


def every_variant(kernel: str) -> dict:
    """Every combination of the kernel's constexpr flags, named by its flags ("plain" for none)."""
    flags = _FLAGS[kernel]
    out = {}
    for bits in range(1 << len(flags)):
        on = [f for i, f in enumerate(flags) if bits >> i & 1]
        out["+".join(on) or "plain"] = Variant(**{f: True for f in on})
    return out


def launch(kernel: str, dtype: torch.dtype, vocab: int, variant: Variant, rows: int = ROWS):
    """``(kernel, grid, args, meta)`` the launcher would use, on meta tensors."""
    from ..backends.triton import launch as L

    def meta(*shape, dt=torch.float32):
        return torch.empty(*shape, dtype=dt, device="meta")

    target = meta(rows, dt=torch.int64)
    weight, weight_sum = (meta(vocab), meta(1)) if variant.weight else (None, None)
    opts = variant.options()
    predicted = meta(rows, dt=torch.int64) if variant.stats else None
    entropy = meta(rows) if variant.entropy else None
    if kernel in TILED:
        return _tiled_launch(kernel, dtype, vocab, variant, rows, meta)
    logits = meta(rows, vocab, dt=dtype)
    if kernel == "forward":   # loss, lse, lse_lo, predicted, entropy
        return L.forward_launch(logits, target, weight, weight_sum, opts, *(meta(rows),) * 3, predicted, entropy)
    if kernel == "slice":     # xmax, argmax, zmax, sumexp, target_logit, zsum; a slice from column 4096
        out = (meta(rows), meta(rows, dt=torch.int64), *(meta(rows),) * 4)
        return L.slice_stats_launch(logits, target, weight, opts, 4096, out)
    if kernel == "chunk":     # grad_row, z_grad_row, loss, lse, lse_lo, predicted, token_weight
        return L.chunk_launch(logits, target, weight, weight_sum, meta(()).expand(rows), meta(rows), opts,
                              *(meta(rows),) * 3, predicted, meta(rows) if variant.dft else None)
    grad_row = meta(()).expand(rows)                 # d(mean)/d(loss_row): a stride-0 scalar
    grad_lse = meta(rows) if variant.zloss else None  # 2 s lse / N per row with z-loss
    return L.backward_launch(logits, target, weight, weight_sum, meta(rows), meta(rows), grad_row, grad_lse,
                             opts, meta(rows, vocab, dt=dtype), grad_entropy=entropy, entropy=entropy)


def _tiled_launch(kernel: str, dtype: torch.dtype, vocab: int, variant: Variant, rows: int, meta):
    """The tiled kernels' launch: hidden (BT, TILED_HIDDEN), weight (V, TILED_HIDDEN), all gradients."""
    from ..backends.triton import tiled as T

    hidden, weight = meta(rows, TILED_HIDDEN, dt=dtype), meta(vocab, TILED_HIDDEN, dt=dtype)
    bias = meta(vocab, dt=dtype) if variant.bias else None
    target = meta(rows, dt=torch.int64)
    w, weight_sum = (meta(vocab), meta(1)) if variant.weight else (None, None)
    opts = variant.options()
    entropy = meta(rows) if variant.entropy else None
    if kernel == "tiled_forward":   # loss, lse, lse_lo, predicted, target_logit, entropy
        return T.tiled_forward_launch(hidden, weight, bias, target, w, weight_sum, opts, *(meta(rows),) * 3,
                                      meta(rows, dt=torch.int64) if variant.stats else None, meta(rows), entropy)
    return T.tiled_backward_launch(hidden, weight, bias, target, w, weight_sum, meta(rows), meta(rows),
                                   meta(()).expand(rows), meta(rows) if variant.zloss else None, entropy, entropy,
                                   opts, meta(rows, TILED_HIDDEN), meta(vocab, TILED_HIDDEN),
                                   meta(vocab) if variant.bias else None)
