"""Per-row math of one vocabulary slice in fp32, with no communication.

A rank holds the columns ``[s, s + V_r)`` of the (softcapped) logits ``z`` of every row. The
single-process row (``backends/reference/rows.py``, ``eps`` = label_smoothing, ``w`` class weights,
``W = sum_c w_c``, ``t`` target, ``V`` the GLOBAL vocabulary size):

    lse  = log sum_c exp(z_c)
    loss = (1 - eps) w_t (lse - z_t) + eps / V (W lse - sum_c w_c z_c) + s_z lse**2

is made of sums over classes, so each slice contributes partial sums that add up over ranks:

    sum_c exp(z_c - M) = sum_r exp(m_r - M) sum_{c in r} exp(z_c - m_r)   (m_r slice max, M global max)
    z_t, w_t           = the owning rank's value (every other rank sends 0)
    sum_c w_c z_c, W   = sums of per-slice sums

(the z-loss ``s_z lse**2`` is added by the reduction, from the global lse). A slice whose logits are all
-inf in a row (a masked or padded part of the vocabulary) takes its sum-exp against 0, not its max
-inf, so it contributes exactly 0 (``exchange.py`` rescales it by 0 too).

The gradient is rows.py's formula with the global ``lse`` (and ``lse_lo``), ``V``, ``W`` and ``w_t``
(all known locally after the forward), so the backward needs no collective:

    dL/dz_c = g ((1 - eps) w_t (p_c - [c == t]) + eps / V (W p_c - w_c)) + h p_c,
    p_c = exp(z_c - lse) exp(-lse_lo);   softcap chain rule dz/dx = 1 - (z / softcap)**2,

with ``g`` and ``h`` the upstream gradients of the row's cross-entropy and of its lse.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...backends.reference.rows import rows_grad, transform
from ...types import LossOptions
from .argmax_key import EMPTY_KEY, pack_max_key
from .layout import VocabLayout


class Columns:
    """Columns of the per-row buffer that the forward all-reduces with SUM, ``(n, k)`` fp32:
    ``sumexp`` (rescaled to the global max before the SUM), ``target_logit`` z_t, ``owned`` (1 on the
    rank holding t: a row nobody owns has an out-of-range target), then ``target_weight`` w_t with
    class weights and ``smooth`` (sum_c w_c z_c) with label smoothing."""

    SUMEXP, TARGET_LOGIT, OWNED = 0, 1, 2

    def __init__(self, weighted: bool, smoothing: bool):
        self.target_weight = 3 if weighted else None
        self.smooth = 3 + int(weighted) if smoothing else None
        self.k = 3 + int(weighted) + int(smoothing)


def target_columns(target: torch.Tensor, layout: VocabLayout):
    """``(owned (n,) bool, col (n,) int64)``: whether this slice holds the row's target and its local
    column (0 where not owned, so gathers never index out of bounds; ignored rows are never owned
    unless ``ignore_index`` is itself a class of this slice, and those rows are zeroed by the caller)."""
    owned = (target >= layout.start) & (target < layout.end)
    col = torch.where(owned, target.long() - layout.start, 0)
    return owned, col


def shard_forward(x: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                  layout: VocabLayout, opts: LossOptions, cols: Columns):
    """Local statistics of a block ``x`` ((n, V_r) fp32 logits of this slice, before softcap).

    ``weight``: this slice's class weights (V_r,) fp32 or None. Returns ``(key (n,) int64, zmax (n,)
    fp32, sums (n, k) fp32)``: the packed (max, lowest global argmax) of ``x`` (``argmax_key``), the
    slice max of ``z`` (``sumexp`` is taken against it, or against 0 where it is -inf), and the
    ``Columns`` of this slice.
    """
    n = x.shape[0]
    sums = x.new_zeros(n, cols.k)
    if layout.size == 0:  # nothing to contribute: every sum stays 0, the key loses the MAX
        key = torch.full((n,), EMPTY_KEY, dtype=torch.int64, device=x.device)
        return key, torch.full((n,), float("-inf"), device=x.device), sums
    z = transform(x, opts)
    xmax, arg = x.max(dim=1)                 # first index among ties, like argmax
    zmax = transform(xmax, opts)            # = max_c z_c: the transform is increasing
    key = pack_max_key(xmax, arg + layout.start)
    owned, col = target_columns(target, layout)
    shift = torch.where(zmax == float("-inf"), 0.0, zmax)   # an all -inf row: sum 0, not NaN
    sums[:, Columns.SUMEXP] = torch.exp(z - shift[:, None]).sum(dim=1)
    sums[:, Columns.TARGET_LOGIT] = torch.where(owned, z.gather(1, col[:, None])[:, 0], 0.0)
    sums[:, Columns.OWNED] = owned.to(torch.float32)
    if cols.target_weight is not None:
        sums[:, cols.target_weight] = torch.where(owned, weight[col], 0.0)
    if cols.smooth is not None:
        sums[:, cols.smooth] = z.sum(dim=1) if weight is None else z @ weight
    return key, zmax, sums


def shard_grad(x: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
               weight_sum: Optional[torch.Tensor], target_weight: Optional[torch.Tensor],
               lse: torch.Tensor, lse_lo: torch.Tensor, grad_row: torch.Tensor,
               grad_lse: Optional[torch.Tensor], layout: VocabLayout, opts: LossOptions) -> torch.Tensor:
    """Gradient of ``sum_i grad_row[i] loss_i + grad_lse[i] lse_i`` w.r.t. this slice's block ``x``
    ((n, V_r) fp32).

    ``weight``: this slice's class weights (V_r,) fp32 or None; ``weight_sum``: the GLOBAL ``W`` (0-dim);
    ``target_weight``: the global ``w_t`` per row (n,) from the forward (None without class weights);
    ``lse``, ``lse_lo``: the global per-row lse pair (n,); ``grad_lse`` None means 0. Returns (n, V_r)
    fp32; ignored rows are exactly 0.
    """
    return rows_grad(x, target, weight, weight_sum, lse, lse_lo, grad_row, grad_lse, opts,
                     n_classes=layout.n_classes, col_start=layout.start, target_weight=target_weight)
