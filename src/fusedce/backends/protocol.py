"""The backend interface, written once: ``Backend`` (with its ``Capabilities``), ``ChunkCE`` (one chunk of
logits, ``method="chunked"``) and ``TiledCE`` (the LM head with no logits, ``method="tiled"``)."""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Protocol, Tuple

import torch

from fusedce.core.options import LossOptions
from fusedce.core.row_math import grad_lse, target_probability

Opt = Optional[torch.Tensor]


class ChunkCE(Protocol):
    """A backend's cross-entropy on one chunk of logits ((n, V), last-dim stride 1)."""

    def loss(self, logits, target, w, weight_sum, opts: LossOptions, stats: bool, entropy: bool = False):
        """-> ``(loss, lse, lse_lo, predicted)``, (n,) each (``predicted`` None without ``stats``); with
        ``entropy`` a fifth element, the entropy (n,) fp32."""

    def grad_(self, logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, opts: LossOptions,
              grad_entropy: Opt = None, entropy: Opt = None, out: Opt = None) -> None:
        """Write d(sum grad_row * loss + grad_lse * lse + grad_entropy * entropy)/d logits into ``out`` (default
        ``logits``)."""

    def token_stats(self, logits, target, lse, lse_lo, opts: LossOptions):
        """-> ``(log_sum_sq_probs, mean_logits, is_top1)`` (n,) fp32, fp32, bool (``types.TokenStats``)
        of the chunk ``logits`` from its lse pair; 0 / False on ignored rows. No gradient."""

    def loss_and_grad_(self, logits, target, w, weight_sum, grad_row, z_grad_row, opts: LossOptions,
                       stats: bool):
        """``loss`` then ``grad_`` in one call (a backend may fuse them), z-loss upstream and token scaling applied."""


class TiledRows(NamedTuple):
    """Per-row results of ``TiledCE.forward`` (see the module docstring). ``target_logit`` is ``z_t``
    (0 on ignored rows); ``predicted`` is all -1 without stats; ``entropy`` None unless asked."""

    loss: torch.Tensor
    lse: torch.Tensor
    lse_lo: torch.Tensor
    predicted: torch.Tensor
    target_logit: torch.Tensor
    entropy: Opt
    token_stats: Optional[tuple] = None   # (log_sum_sq_probs, mean_logits, is_top1) when asked


class TiledCE(Protocol):
    """A backend's LM head + loss with no logits tensor of V or more elements (``method="tiled"``)."""

    def forward(self, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, stats: bool,
                entropy: bool = False, token_stats: bool = False, batch_invariant: bool = False) -> TiledRows:
        """With ``token_stats`` the rows' ``TiledRows.token_stats`` too, in the same pass;
        ``batch_invariant``: the tiles of ``invariant_rows`` (n then a multiple of it)."""
        ...

    def backward(self, hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse: Opt,
                 opts: LossOptions, needs: Tuple[bool, bool, bool], accum_dtype: torch.dtype,
                 grad_entropy: Opt = None, entropy: Opt = None, deterministic: bool = False,
                 batch_invariant: bool = False) -> Tuple[Opt, Opt, Opt]:
        """``(grad_hidden, grad_weight, grad_bias)`` of ``sum_i grad_row[i] loss_i + grad_lse[i] lse_i +
        grad_entropy[i] entropy_i``; ``needs`` says which (None for the others)."""
        ...

    def invariant_rows(self, n_classes: int) -> int:
        """``batch_invariant``: rows padded to a multiple of this, so every token tile is equally tall
        (``lm_head/invariant.py``)."""
        ...


def loss_then_grad_(ce, logits, target, w, weight_sum, grad_row, z_grad_row, opts: LossOptions, stats: bool):
    """``ChunkCE.loss_and_grad_`` from ``ce.loss`` then ``ce.grad_``: ``(loss, lse, lse_lo, predicted,
    token_weight)``, ``logits`` overwritten with its gradient (token scaling's ``p_t`` applied)."""
    loss, lse, lse_lo, predicted = ce.loss(logits, target, w, weight_sum, opts, stats)
    token_weight = target_probability(logits, target, lse, lse_lo, opts) if opts.use_token_scaling else None
    if token_weight is not None:
        grad_row, z_grad_row = grad_row * token_weight, z_grad_row * token_weight
    ce.grad_(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse(lse, z_grad_row, opts), opts)
    return loss, lse, lse_lo, predicted, token_weight


class Capabilities(NamedTuple):
    """What a backend can compute beyond ``cross_entropy_rows`` and the chunked LM head (which every backend has)."""

    tiled: bool      # method="tiled": a TiledCE (``Backend.TILED_CE``)
    entropy: bool    # the RL ops: ChunkCE.loss(entropy=True), grad_(grad_entropy=), token_stats
    slices: bool     # vocabulary slices (``slice_stats`` / ``slice_grad``) for fusedce.distributed
    probs_targets: bool   # probability targets: ``probs_cross_entropy_rows`` (``fusedce/ce/probs_targets.py``)
    distill: bool    # distillation: ``distill_rows`` / ``tiled_distill`` (``fusedce/distill/distillation.py``)


class Backend(Protocol):
    """A backend package (``backends/pytorch``, ``backends/triton``, ``backends/cute``) as the layers above see it."""

    NAME: str                       # "torch", "triton", "cute"
    CAPABILITIES: Capabilities
    CHUNK_CE: ChunkCE               # the per-chunk cross-entropy of the chunked LM head and the RL ops
    TILED_CE: Optional[TiledCE]     # None unless CAPABILITIES.tiled

    cross_entropy_rows: Callable
    """``cross_entropy_rows(logits2d, target1d, weight, opts, inplace_backward, stats)`` -> ``(ce_row,
    lse, lse_lo, predicted)``: per-row fp32 cross-entropy WITHOUT the z-loss and per-row fp32 lse (both
    differentiable w.r.t. ``logits2d``; 0 on ignored rows), lse's fp32 rounding error (``lse + lse_lo``
    exact; no gradient), int64 argmax (-1 on ignored rows, empty without ``stats``); no reduction (the
    z-loss is built from ``lse`` by ``core/reduction.py``, so its gradient reaches the backend as the
    upstream gradient of ``lse``)."""
    probs_cross_entropy_rows: Optional[Callable]
    """``probs_cross_entropy_rows(logits2d, q2d, weight, opts, inplace_backward, stats)``: the same four
    outputs for probability targets ``q2d`` ((BT, V), any float dtype; no row ignored); only with
    ``CAPABILITIES.probs_targets`` (``fusedce/ce/probs_targets.py`` refuses the others)."""
    distill_rows: Optional[Callable]
    """The distillation loss of rows of student / teacher logits (``distill/linear_head.py`` drives it); only
    with ``CAPABILITIES.distill``."""
    tiled_distill: Optional[Callable]
    """The distillation loss of both LM heads with no logits tensor (``method="tiled"``); only with
    ``CAPABILITIES.distill``. Its attribute ``invariant_rows(V)``: as ``TiledCE.invariant_rows`` (the
    tiled distillation kernels take the tiled cross-entropy's token tiles)."""
    slice_stats: Callable
    """``slice_stats(logits, target, weight, opts, col_start) -> types.SliceStats`` on a vocabulary slice."""
    slice_grad: Callable
    """``slice_grad(logits, target, weight, weight_sum, target_weight, lse, lse_lo, grad_row, grad_lse,
    opts, col_start, n_total)``: the slice's gradient from the global row statistics."""
