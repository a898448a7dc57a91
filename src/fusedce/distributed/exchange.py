"""The forward's communication: two ``all_reduce`` of per-row statistics, O(BT) bytes, never logits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fusedce.core.row_math import row_loss, transform, two_sum
from fusedce.core.options import LossOptions
from fusedce.distributed.argmax_key import unpack_max_key
from fusedce.distributed.layout import VocabLayout
from fusedce.distributed.shard_rows import Columns


@dataclass
class Partials:
    """This rank's per-row statistics before the exchange: ``key`` (n,) int64, ``zmax`` (n,) fp32 and ``sums``
    (n, k) fp32, a view of ``flat`` whose last element holds the slice's ``sum_c w_c`` with class weights."""

    key: torch.Tensor
    zmax: torch.Tensor
    flat: torch.Tensor
    sums: torch.Tensor

    def set_(self, key: torch.Tensor, zmax: torch.Tensor, sums: torch.Tensor) -> None:
        """Copy a forward's ``(key, zmax, sums)`` (``chunk_ops.forward``) into these buffers."""
        self.key.copy_(key)
        self.zmax.copy_(zmax)
        self.sums.copy_(sums)

    @classmethod
    def allocate(cls, n: int, cols: Columns, weighted: bool, device: torch.device) -> "Partials":
        flat = torch.empty(n * cols.k + int(weighted), dtype=torch.float32, device=device)
        return cls(key=torch.empty(n, dtype=torch.int64, device=device),
                   zmax=torch.empty(n, dtype=torch.float32, device=device),
                   flat=flat, sums=flat[: n * cols.k].view(n, cols.k))


@dataclass
class GlobalRows:
    """Per-row results on the global vocabulary, the same on every rank (fp32 ``(n,)`` unless said; 0 on ignored
    rows): ``loss`` without z-loss, the lse pair, ``predicted`` int64 (-1 ignored), the class-weight terms
    ``target_weight`` / ``weight_sum`` (or None), ``target_prob`` ``p_t`` and ``entropy`` (or None)."""

    loss: torch.Tensor
    lse: torch.Tensor
    lse_lo: torch.Tensor
    target_prob: torch.Tensor
    predicted: torch.Tensor
    target_weight: Optional[torch.Tensor]
    weight_sum: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor] = None


def sum_over_ranks_(t: torch.Tensor, group, ordered: bool = False) -> torch.Tensor:
    """``t`` (in place) summed over the ranks of ``group``: ``all_reduce(SUM)``, or with ``ordered`` an
    ``all_gather`` folded in rank order, so that each element's sum has one order whatever the tensor's
    length (``batch_invariant=True``; an all-reduce's order may follow the element's position)."""
    if not ordered:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    t.copy_(parts[0])
    for part in parts[1:]:
        t += part
    return t


def exchange(p: Partials, target: torch.Tensor, weight: Optional[torch.Tensor], layout: VocabLayout,
             opts: LossOptions, cols: Columns, ordered: bool = False) -> GlobalRows:
    """Run the two collectives on ``p`` (modified in place) and finish the per-row loss (``ordered``: the
    sums as ``sum_over_ranks_``'s)."""
    n, device = target.shape[0], target.device
    weighted = weight is not None
    if weighted:
        p.flat[-1] = weight.sum()
    if n > 0:
        dist.all_reduce(p.key, op=dist.ReduceOp.MAX, group=layout.group)          # collective 1
        xmax, index = unpack_max_key(p.key)
        gmax = transform(xmax, opts)
        gmax = torch.where(gmax == float("-inf"), 0.0, gmax)   # a row -inf on every rank: lse = -inf
        # p.zmax = -inf: this slice's logits are all -inf in that row (sumexp = 0): it adds exactly 0
        empty = p.zmax == float("-inf")
        if cols.tsum is not None:   # re-based before sumexp is (it reads the slice's own sumexp)
            d = torch.where(empty, 0.0, p.zmax - gmax)
            p.sums[:, cols.tsum] = torch.where(
                empty, 0.0, torch.exp(d) * (p.sums[:, cols.tsum] + d * p.sums[:, Columns.SUMEXP]))
        p.sums[:, Columns.SUMEXP] *= torch.where(empty, 0.0, torch.exp(p.zmax - gmax))
        sum_over_ranks_(p.flat, layout.group, ordered)                            # collective 2
    else:
        gmax = torch.zeros(0, device=device)
        index = torch.zeros(0, dtype=torch.int64, device=device)

    s = p.sums
    lse, lse_lo = two_sum(gmax, torch.log(s[:, Columns.SUMEXP]))
    w_t = s[:, cols.target_weight] if weighted else None
    weight_sum = p.flat[-1] if weighted else None
    zsum = None if cols.smooth is None else s[:, cols.smooth]
    loss = row_loss(lse, lse_lo, s[:, Columns.TARGET_LOGIT], w_t, zsum,
                    weight_sum if weighted else float(layout.n_classes), layout.n_classes, opts)
    valid = opts.kept(target)
    loss = torch.where(s[:, Columns.OWNED] > 0, loss, float("nan"))
    loss = torch.where(valid, loss, 0.0)
    target_prob = torch.where(valid & (s[:, Columns.OWNED] > 0),
                              torch.exp((s[:, Columns.TARGET_LOGIT] - lse) - lse_lo), 0.0)
    entropy = None
    if cols.tsum is not None:   # -sum p log p = log S - T / S (both shifted by the global max: no cancellation)
        sumexp = torch.where(valid, s[:, Columns.SUMEXP], 1.0)
        entropy = torch.where(valid, torch.log(sumexp) - s[:, cols.tsum] / sumexp, 0.0)
    lse, lse_lo = torch.where(valid, lse, 0.0), torch.where(valid, lse_lo, 0.0)
    predicted = torch.where(valid, index, -1)
    return GlobalRows(loss=loss, lse=lse, lse_lo=lse_lo, target_prob=target_prob, predicted=predicted,
                      target_weight=None if w_t is None else w_t.clone(),
                      weight_sum=None if weight_sum is None else weight_sum.clone(), entropy=entropy)


def exchange_ce(n: int, weight: Optional[torch.Tensor], target: torch.Tensor, layout: VocabLayout,
                opts: LossOptions, fill) -> tuple:
    """The cross-entropy ops' forward around the backend: the rows' partial statistics that ``fill`` writes, then
    ``exchange``."""
    w = None if weight is None else weight.float()
    cols = Columns(w is not None, opts.label_smoothing > 0.0)
    p = Partials.allocate(n, cols, w is not None, target.device)
    fill(p, w, cols)
    return w, exchange(p, target, w, layout, opts, cols)


def ce_outputs(ctx, out: GlobalRows) -> tuple:
    """The cross-entropy Functions' outputs ``(loss, lse, predicted, w_t, target_prob)`` (``w_t`` (0,)
    without class weights); all but loss and lse marked non-differentiable on ``ctx``."""
    w_t = out.lse.new_empty(0) if out.target_weight is None else out.target_weight
    ctx.mark_non_differentiable(out.predicted, w_t, out.target_prob)
    return out.loss, out.lse, out.predicted, w_t, out.target_prob
