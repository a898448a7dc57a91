"""What ``fusedce inspect`` compiles: the kernels, their representative constexpr-flag combinations, the
vocabularies and dtypes, and each launch built exactly as the launcher builds it (on meta tensors)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedce.core.options import LossFlags, LossOptions
from . import distill_variants as DV

# chunk: the fused loss + gradient of linear_cross_entropy; slice: the partial statistics of a vocabulary
# slice (vocab parallelism; its gradient is the backward kernel with a column offset)
# tiled_grad_hidden / tiled_grad_weight: the deterministic tiled backward (no atomics)
# probs_forward / probs_backward: probability targets (``kernels/probs_*.py``; the target in the logits' dtype)
KERNELS = ("forward", "backward", "chunk", "slice", "tiled_forward", "tiled_backward", "tiled_grad_hidden",
           "tiled_grad_weight", "probs_forward", "probs_backward")   # the cross-entropy kernels (they take the
# loss options: ``options.LossOptions``) with the distillation kernels (``distill_variants.py``: their own
# options, variants and launches)
SOFT = ("probs_forward", "probs_backward")
ALL_KERNELS = KERNELS + DV.DISTILL_KERNELS
TILED = ("tiled_forward", "tiled_backward", "tiled_grad_hidden", "tiled_grad_weight") + DV.DISTILL_TILED
# the no-logits LM head (method="tiled", and tiled distillation): V is the head's rows
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


# The loss options' flags (``options.LossFlags``) by short name: HAS_WEIGHT -> "weight". A new flag is
# compiled by ``--every-variant`` and in every "all" variant with no edit here.
LOSS_FLAGS = {f.lower().removeprefix("has_"): f for f in LossFlags._fields}
ALL = frozenset(LOSS_FLAGS)


@dataclass(frozen=True)
class Variant:
    """Loss options and outputs that select the kernels' constexpr flags: ``loss`` the short names of the options'
    flags that are on, the others per-launch flags."""

    loss: frozenset = frozenset()
    stats: bool = False
    zloss: bool = False
    dft: bool = False
    entropy: bool = False   # forward: COMPUTE_ENTROPY; backward: HAS_GRAD_ENTROPY (the RL ops)
    bias: bool = False      # tiled kernels: HAS_BIAS

    def flags(self) -> LossFlags:
        """The kernels' ``FLAGS`` for this variant."""
        return LossFlags(**{field: name in self.loss for name, field in LOSS_FLAGS.items()})

    def options(self) -> LossOptions:
        return LossOptions.selecting(self.flags(), lse_square_scale=1e-4 if self.zloss else 0.0,
                                     use_token_scaling=self.dft)

    @property
    def weight(self) -> bool:
        return "weight" in self.loss


def _v(*loss: str, **features) -> Variant:
    return Variant(frozenset(loss), **features)


# The representative flag combinations shown by default (``--every-variant``: all of them).
VARIANTS = {
    "forward": {
        "plain": _v(),
        "stats": _v(stats=True),
        "weight": _v("weight"),
        "softcap": _v("softcap"),
        "smooth": _v("smoothing"),
        "smooth+weight": _v("weight", "smoothing"),
        "all": Variant(ALL, stats=True),
        "entropy": _v(entropy=True),
        "entropy+softcap": _v("softcap", entropy=True),
    },
    "backward": {
        "plain": _v(),
        "softcap": _v("softcap"),
        "smooth+weight": _v("weight", "smoothing"),
        "all": Variant(ALL, zloss=True),
        "entropy": _v(zloss=True, entropy=True),
        "entropy+softcap": _v("softcap", zloss=True, entropy=True),
    },
    "tiled_forward": {
        "plain": _v(),
        "entropy": _v(entropy=True),
        "all": Variant(ALL, stats=True, entropy=True, bias=True),
    },
    "tiled_backward": {
        "plain": _v(),
        "entropy": _v(zloss=True, entropy=True),
        "all": Variant(ALL, zloss=True, entropy=True, bias=True),
    },
    "tiled_grad_hidden": {
        "plain": _v(),
        "entropy": _v(zloss=True, entropy=True),
        "all": Variant(ALL, zloss=True, entropy=True, bias=True),
    },
    "tiled_grad_weight": {
        "plain": _v(),
        "entropy": _v(zloss=True, entropy=True),
        "all": Variant(ALL, zloss=True, entropy=True, bias=True),
    },
    "slice": {
        "plain": _v(),
        "all": Variant(ALL),
        "entropy+softcap": _v("softcap", entropy=True),   # the vocab-parallel RL ops' statistics
    },
    "probs_forward": {
        "plain": _v(),
        "stats": _v(stats=True),
        "smooth+weight": _v("weight", "smoothing"),
        "all": Variant(ALL, stats=True),
    },
    "probs_backward": {
        "plain": _v(),
        "softcap": _v("softcap"),
        "smooth+weight": _v("weight", "smoothing"),
        "all": Variant(ALL, zloss=True),
    },
    "chunk": {
        "plain": _v(),
        "softcap": _v("softcap"),
        "smooth+weight": _v("weight", "smoothing"),
        "all": Variant(ALL, stats=True, zloss=True, dft=True),
    },
    **DV.VARIANTS,
}
# Each kernel's per-launch flags besides the loss options' (all of which every kernel takes).
_FEATURES = {"forward": ("stats",),
             "backward": ("zloss",),
             "chunk": ("stats", "zloss", "dft"),
             "slice": (),
             "probs_forward": ("stats",),
             "probs_backward": ("zloss",),
             "tiled_forward": ("stats", "entropy", "bias"),
             "tiled_backward": ("zloss", "entropy", "bias"),
             "tiled_grad_hidden": ("zloss", "entropy", "bias"),
             "tiled_grad_weight": ("zloss", "entropy", "bias")}


def every_variant(kernel: str) -> dict:
    """Every combination of the kernel's constexpr flags, named by its flags ("plain" for none)."""
    if kernel in DV.DISTILL_KERNELS:
        return DV.every_variant(kernel)
    flags = tuple(LOSS_FLAGS) + _FEATURES[kernel]
    out = {}
    for bits in range(1 << len(flags)):
        on = [f for i, f in enumerate(flags) if bits >> i & 1]
        out["+".join(on) or "plain"] = Variant(frozenset(f for f in on if f in LOSS_FLAGS),
                                               **{f: True for f in on if f not in LOSS_FLAGS})
    return out


def launch(kernel: str, dtype: torch.dtype, vocab: int, variant: Variant, rows: int = ROWS):
    """``(kernel, grid, args, meta)`` the launcher would use, on meta tensors."""
    if kernel in DV.DISTILL_KERNELS:
        return DV.launch(kernel, dtype, vocab, variant, rows)
    fn, grid, args, meta = _launch(kernel, dtype, vocab, variant, rows)
    assert meta["FLAGS"] == variant.flags(), (kernel, meta["FLAGS"], variant)   # the variant is what it says
    return fn, grid, args, meta


def _launch(kernel: str, dtype: torch.dtype, vocab: int, variant: Variant, rows: int):
    from ...backends.triton import launch as L

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
    if kernel in SOFT:
        return _probs_launch(kernel, logits, meta(rows, vocab, dt=dtype), weight, opts, variant, rows, meta)
    if kernel == "forward":   # loss, lse, lse_lo, predicted, entropy
        return L.forward_launch(logits, target, weight, weight_sum, opts, *(meta(rows),) * 3, predicted, entropy)
    if kernel == "slice":     # xmax, argmax, zmax, sumexp, target_logit, zsum[, tsum]; a slice from column 4096
        out = (meta(rows), meta(rows, dt=torch.int64), *(meta(rows),) * 4) + ((entropy,) if variant.entropy else ())
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
    from ...backends.triton import tiled as T

    hidden, weight = meta(rows, TILED_HIDDEN, dt=dtype), meta(vocab, TILED_HIDDEN, dt=dtype)
    bias = meta(vocab, dt=dtype) if variant.bias else None
    target = meta(rows, dt=torch.int64)
    w, weight_sum = (meta(vocab), meta(1)) if variant.weight else (None, None)
    opts = variant.options()
    entropy = meta(rows) if variant.entropy else None
    if kernel == "tiled_forward":   # loss, lse, lse_lo, predicted, target_logit, entropy
        return T.tiled_forward_launch(hidden, weight, bias, target, w, weight_sum, opts, *(meta(rows),) * 3,
                                      meta(rows, dt=torch.int64) if variant.stats else None, meta(rows), entropy)
    common = (hidden, weight, bias, target, w, weight_sum, meta(rows), meta(rows), meta(()).expand(rows),
              meta(rows) if variant.zloss else None, entropy, entropy, opts)
    grad_bias = meta(vocab) if variant.bias else None
    if kernel == "tiled_grad_hidden":
        return T.tiled_grad_hidden_launch(*common, meta(rows, TILED_HIDDEN))
    if kernel == "tiled_grad_weight":
        return T.tiled_grad_weight_launch(*common, meta(vocab, TILED_HIDDEN), grad_bias)
    return T.tiled_backward_launch(*common, meta(rows, TILED_HIDDEN), meta(vocab, TILED_HIDDEN), grad_bias)


def _probs_launch(kernel: str, logits, q, weight, opts: LossOptions, variant: Variant, rows: int, meta):
    """The probability-target kernels' launch: ``q`` (BT, V) in the logits' dtype."""
    from ...backends.triton import probs_launch as S

    if kernel == "probs_forward":   # loss, lse, lse_lo, a, predicted
        return S.probs_forward_launch(logits, q, weight, opts, *(meta(rows),) * 4,
                                     meta(rows, dt=torch.int64) if variant.stats else None)
    return S.probs_backward_launch(logits, q, weight, meta(rows), meta(rows), meta(rows), meta(()).expand(rows),
                                  meta(rows) if variant.zloss else None, opts, meta(*logits.shape, dt=logits.dtype))
