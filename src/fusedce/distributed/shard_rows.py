"""One vocabulary slice's side of the exchange: the backend's partial statistics arranged for the collectives, and the
slice's gradient."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.options import LossOptions
from fusedce.distributed.argmax_key import EMPTY_KEY, pack_max_key
from fusedce.distributed.layout import VocabLayout


class Columns:
    """Columns of the ``(n, k)`` fp32 buffer the forward all-reduces with SUM: ``sumexp``, ``target_logit``,
    ``owned``, then ``target_weight`` (class weights), ``smooth`` (label smoothing), ``tsum`` (entropy)."""

    SUMEXP, TARGET_LOGIT, OWNED = 0, 1, 2

    def __init__(self, weighted: bool, smoothing: bool, entropy: bool = False):
        self.target_weight = 3 if weighted else None
        self.smooth = 3 + int(weighted) if smoothing else None
        self.tsum = 3 + int(weighted) + int(smoothing) if entropy else None
        self.k = 3 + int(weighted) + int(smoothing) + int(entropy)


def target_columns(target: torch.Tensor, layout: VocabLayout):
    """``(owned (n,) bool, col (n,) int64)``: whether this slice holds the row's target, and its local column (0
    where not owned)."""
    owned = (target >= layout.start) & (target < layout.end)
    col = torch.where(owned, target.long() - layout.start, 0)
    return owned, col


def shard_forward(impl, logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                  layout: VocabLayout, opts: LossOptions, cols: Columns):
    """Local statistics of this slice's logits ``(n, V_r)`` (any float dtype, before the logit transform), computed by
    the backend ``impl`` (``slice_stats``: its kernels, no math here)."""
    n = logits.shape[0]
    sums = torch.zeros(n, cols.k, device=logits.device)
    if layout.size == 0:  # nothing to contribute: every sum stays 0, the key loses the MAX
        key = torch.full((n,), EMPTY_KEY, dtype=torch.int64, device=logits.device)
        return key, torch.full((n,), float("-inf"), device=logits.device), sums
    if cols.tsum is None:
        st = impl.slice_stats(logits, target, weight, opts, layout.start)
    else:
        st = impl.slice_stats(logits, target, weight, opts, layout.start, entropy=True)
    owned, col = target_columns(target, layout)
    sums[:, Columns.SUMEXP] = st.sumexp
    sums[:, Columns.TARGET_LOGIT] = st.target_logit
    sums[:, Columns.OWNED] = owned.to(torch.float32)
    if cols.target_weight is not None:
        sums[:, cols.target_weight] = torch.where(owned, weight[col], 0.0)
    if cols.smooth is not None:
        sums[:, cols.smooth] = st.zsum
    if cols.tsum is not None:
        sums[:, cols.tsum] = st.tsum
    return pack_max_key(st.xmax, st.argmax), st.zmax, sums


def shard_grad(impl, logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
               weight_sum: Optional[torch.Tensor], target_weight: Optional[torch.Tensor],
               lse: torch.Tensor, lse_lo: torch.Tensor, grad_row: torch.Tensor,
               grad_lse: Optional[torch.Tensor], layout: VocabLayout, opts: LossOptions,
               grad_entropy: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gradient of ``sum_i grad_row[i] loss_i + grad_lse[i] lse_i [+ grad_entropy[i] entropy_i]`` w.r.t. this slice's
    logits ``(n, V_r)``, in their dtype, by the backend ``impl`` (``slice_grad``)."""
    if grad_entropy is None:
        return impl.slice_grad(logits, target, weight, weight_sum, target_weight, lse, lse_lo, grad_row, grad_lse,
                               opts, layout.start, layout.n_classes)
    return impl.slice_grad(logits, target, weight, weight_sum, target_weight, lse, lse_lo, grad_row, grad_lse,
                           opts, layout.start, layout.n_classes, grad_entropy=grad_entropy, entropy=entropy)
