"""The per-row math of ``sampled_log_probs.py`` on one chunk of this rank's vocabulary slice: ``q`` ``(n, V_r)``
fp32 (the transformed logits over the temperature), its columns global ids ``[start, start + V_r)``.

The sampler's kept set is ``q >= thr`` per row, with ``thr`` the single-process op's (``rl/truncated_rows.py``):
the k-th largest value of the row (ties at it kept), then the smallest value whose strictly-larger mass
(under the top-k renormalization) is below ``top_p``. Both are found without gathering the vocabulary: one ``top_k`` for
every row as the k-th largest of every rank's k largest (gathered: k values per row and rank); otherwise a
bisection on fp32's ordered bit pattern (``_key``) whose predicate is a per-row count (top-k) or kept mass
(top-p) summed over the ranks; each step one ``all_reduce`` of ``n`` numbers, ``STEPS`` steps (fixed: no host
sync), and each predicate monotone in the key, so the bisection ends on an attained value, exactly the
single-process threshold (the top-p mass is summed in another order than its sorted ``cumsum``: a row whose
mass ties ``top_p`` within fp32 rounding may keep one tie group more or less).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fusedce.distributed.argmax_key import pack_max_key, unpack_max_key
from fusedce.distributed.exchange import sum_over_ranks_
from fusedce.distributed.layout import VocabLayout

NEG_INF = float("-inf")
_MAGNITUDE = 0x7FFFFFFF
KEY_LO = -2139095041   # _key(-inf)
KEY_HI = 2139095040    # _key(+inf)
STEPS = 33             # ceil(log2(KEY_HI - KEY_LO + 2)): the bisection's interval down to one key


def _key(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64, monotone (``a < b`` implies ``_key(a) < _key(b)``; -0.0 just below +0.0)."""
    bits = v.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ _MAGNITUDE)


def _value(key: torch.Tensor) -> torch.Tensor:
    bits = torch.where(key >= 0, key, key ^ _MAGNITUDE)
    return bits.to(torch.int32).view(torch.float32)


def _all_reduce(t: torch.Tensor, layout: VocabLayout, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if op == dist.ReduceOp.SUM:
        return sum_over_ranks_(t, layout.group)
    dist.all_reduce(t, op=op, group=layout.group)
    return t


def _global_max(q: torch.Tensor, layout: VocabLayout):
    """``(max, argmax)`` (n,) of the rows over every rank (the lowest global id among ties)."""
    n = q.shape[0]
    if q.shape[1]:
        local, index = q.max(dim=1)
        key = pack_max_key(local, index + layout.start)
    else:
        key = torch.full((n,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=q.device)
    return unpack_max_key(_all_reduce(key, layout, dist.ReduceOp.MAX))


def _top_k_threshold(q: torch.Tensor, k: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    """(n,) the k-th largest ``q`` of each row over the ranks: the largest key whose value has at least ``k``
    values ``>=`` it (``k`` (n,) int64, 0 for off: the whole row)."""
    k = torch.where(k > 0, k.clamp(max=layout.n_classes), layout.n_classes)
    lo = torch.full_like(k, KEY_LO)       # the predicate holds here (every value >= -inf)
    hi = torch.full_like(k, KEY_HI + 1)   # and never here
    for _ in range(STEPS):
        mid = torch.div(lo + hi, 2, rounding_mode="floor")
        count = _all_reduce((q >= _value(mid)[:, None]).sum(dim=1), layout)
        ok = count >= k
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
    return _value(lo)


def _top_k_scalar_threshold(q: torch.Tensor, k: int, layout: VocabLayout) -> torch.Tensor:
    """(n,) the k-th largest ``q`` of each row for one ``k`` >= 1 of the whole call: the k-th largest of every
    rank's k largest (padded with -inf to k columns), gathered (one ``all_gather`` of n x k fp32 per rank):
    exact, ties included (values, not ids, decide)."""
    k = min(k, layout.n_classes)
    local = min(k, q.shape[1])
    top = torch.full((q.shape[0], k), NEG_INF, device=q.device)
    if local:
        top[:, :local] = q.topk(local, dim=1).values
    parts = [torch.empty_like(top) for _ in range(dist.get_world_size(layout.group))]
    dist.all_gather(parts, top, group=layout.group)
    return torch.cat(parts, dim=1).topk(k, dim=1).values[:, -1]


def _top_p_threshold(q: torch.Tensor, thr_k: torch.Tensor, gmax: torch.Tensor, top_p: torch.Tensor,
                     layout: VocabLayout) -> torch.Tensor:
    """(n,) the smallest value of each row's top-k set whose strictly-larger mass (the top-k set renormalized)
    is below ``top_p`` (>= 1: off, ``thr_k`` kept); the row's max always qualifies."""
    in_k = q >= thr_k[:, None]
    e = torch.where(in_k, torch.exp(q - gmax[:, None]), 0.0)
    total = _all_reduce(e.sum(dim=1), layout)
    p = e / torch.where(total > 0, total, 1.0)[:, None]
    lo = _key(thr_k) - 1                  # all of the set above: mass 1 >= top_p (the predicate fails)
    hi = _key(gmax)                       # nothing above the max: mass 0 < top_p
    for _ in range(STEPS):   # mid rounded up: strictly inside (lo, hi] (never lo, whose value may be a NaN)
        mid = torch.div(lo + hi + 1, 2, rounding_mode="floor")
        above = _all_reduce(torch.where(q > _value(mid)[:, None], p, 0.0).sum(dim=1), layout)
        ok = above < top_p
        lo, hi = torch.where(ok, lo, mid), torch.where(ok, mid, hi)
    return torch.where(top_p >= 1.0, thr_k, torch.maximum(_value(hi), thr_k))


@dataclass
class RowResults:
    """A chunk's global per-row results (n,): ``log_prob``, ``entropy`` (None unless asked), ``lse`` of the
    kept set, ``thr`` (the kept set is ``q >= thr``; -inf untruncated), ``inside`` (bool: the target kept,
    its row finite), ``stats`` (``(log_sum_sq_probs, mean_logits, is_top1)`` or None)."""

    log_prob: torch.Tensor
    entropy: Optional[torch.Tensor]
    lse: torch.Tensor
    thr: torch.Tensor
    inside: torch.Tensor
    stats: Optional[tuple]


def forward(q: torch.Tensor, target: torch.Tensor, top_k, top_p: Optional[torch.Tensor],
            layout: VocabLayout, want_entropy: bool, want_stats: bool) -> RowResults:
    """The chunk's results (``RowResults``): ``target`` (n,) global ids of kept rows; ``top_k`` an int >= 1
    for every row (``_top_k_scalar_threshold``), (n,) per row or None, ``top_p`` (n,) or None (off for the
    whole call); the collectives of the module docstring, then one ``all_reduce`` of the per-row sums."""
    n = q.shape[0]
    gmax, argmax = _global_max(q, layout)
    finite_max = gmax > NEG_INF
    gmax = torch.where(finite_max, gmax, 0.0)   # a row -inf everywhere: no distribution (NaN below)
    thr = torch.full((n,), NEG_INF, device=q.device)
    if isinstance(top_k, int):
        thr = _top_k_scalar_threshold(q, top_k, layout)
    elif top_k is not None:
        thr = _top_k_threshold(q, top_k, layout)
    if top_p is not None:
        thr = _top_p_threshold(q, thr, gmax, top_p, layout)
    kept = q >= thr[:, None]
    shifted = q - gmax[:, None]
    e = torch.where(kept, torch.exp(shifted), 0.0)
    owned = (target >= layout.start) & (target < layout.end)
    col = torch.where(owned, target - layout.start, 0)[:, None]
    q_t = q.gather(1, col).squeeze(1) if layout.size else q.new_zeros(n)
    owned_in = owned & (q_t >= thr)
    cols = [e.sum(dim=1), torch.where(owned_in, q_t, 0.0), owned_in.float()]
    if want_entropy:   # sum_S e (q - max): the entropy's log S - T / S, both shifted by the max
        cols.append(torch.where(e > 0, e * shifted, 0.0).sum(dim=1))
    if want_stats:     # sum_c exp(2 (q_c - max)) and sum_c q_c (untruncated: kept is every class)
        cols += [(e * e).sum(dim=1), q.sum(dim=1)]
    sums = _all_reduce(torch.stack(cols, dim=1), layout)
    s = sums[:, 0]
    finite = finite_max & (s > 0)
    safe_s = torch.where(finite, s, 1.0)
    lse = torch.where(finite, gmax + torch.log(safe_s), NEG_INF)
    inside = (sums[:, 2] > 0) & finite
    log_prob = torch.where(inside, sums[:, 1] - lse, torch.where(finite, NEG_INF, float("nan")))
    entropy = None
    if want_entropy:
        entropy = torch.where(finite, torch.log(safe_s) - sums[:, 3] / safe_s, float("nan"))
    stats = None
    if want_stats:
        col_sq = 4 if want_entropy else 3
        log_sum_sq = torch.log(sums[:, col_sq]) - 2.0 * torch.log(safe_s)
        stats = (log_sum_sq, sums[:, col_sq + 1] / layout.n_classes, argmax == target)
    return RowResults(log_prob, entropy, lse, thr, inside, stats)


def grad_q(q: torch.Tensor, target: torch.Tensor, r_thr: torch.Tensor, lse: torch.Tensor, inside: torch.Tensor,
           entropy: Optional[torch.Tensor], g_log_prob: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor],
           layout: VocabLayout) -> torch.Tensor:
    """``(n, V_r)`` fp32 gradient of ``sum(g_log_prob * log_prob + g_entropy * entropy)`` with respect to this
    slice's ``q`` (either upstream None: unused; ignored rows must carry 0), zero outside each kept set."""
    finite = lse > NEG_INF
    kept = (q >= r_thr[:, None]) & finite[:, None]
    p = torch.where(kept, torch.exp(q - torch.where(finite, lse, 0.0)[:, None]), 0.0)
    grad = torch.zeros_like(q)
    if g_log_prob is not None:
        g = torch.where(inside, g_log_prob.float(), 0.0)
        grad -= g[:, None] * p
        owned = (target >= layout.start) & (target < layout.end)
        if layout.size:
            col = torch.where(owned, target - layout.start, 0)[:, None]
            grad.scatter_add_(1, col, torch.where(owned, g, 0.0)[:, None])
    if g_entropy is not None:
        centered = torch.where(p > 0, q - lse[:, None] + entropy[:, None], 0.0)
        grad -= g_entropy.float()[:, None] * p * centered
    return grad
