"""The per-row math of the sampler's truncated distribution (``top_k`` / ``top_p``) on one chunk of fp32
``q = transform(x) / temperature``, every backend alike."""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def per_row(value, n: int, dtype: torch.dtype, off, device) -> torch.Tensor:
    """``(n,)`` tensor of ``dtype`` from a checked ``top_k`` / ``top_p`` (None, a number, or n elements)."""
    if value is None:
        value = off
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).to(device=device, dtype=dtype)
    return torch.full((n,), value, dtype=dtype, device=device)


def threshold(q: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``(n, 1)`` fp32: the smallest kept ``q`` of each row (``top_k`` 0 and ``top_p`` >= 1: off)."""
    v = q.shape[1]
    sorted_q = torch.sort(q, dim=1, descending=True).values
    k = torch.where(top_k > 0, top_k.clamp(max=v), v) - 1
    in_k = sorted_q >= sorted_q.gather(1, k[:, None])
    p = torch.softmax(sorted_q.masked_fill(~in_k, NEG_INF), dim=1).nan_to_num_(0.0)   # all -inf row: 0
    before = torch.zeros_like(p)   # the mass ahead in the sorted order: at the first of a tie group, the
    torch.cumsum(p[:, :-1], dim=1, out=before[:, 1:])   # group's strictly-larger mass, and no less after it
    keep = in_k & ((before < top_p[:, None]) | (top_p >= 1.0)[:, None])
    count = keep.sum(dim=1, keepdim=True).clamp_(min=1)
    return sorted_q.gather(1, count - 1)   # the last kept position's value: its whole tie group is kept


def forward(q: torch.Tensor, target: torch.Tensor, thr: torch.Tensor, want_entropy: bool):
    """``(log_prob, entropy or None, lse_S)`` (n,) fp32 of the rows of ``q`` kept at ``q >= thr``."""
    kept = q >= thr
    lse = torch.logsumexp(q.masked_fill(~kept, NEG_INF), dim=1)
    finite = lse > NEG_INF
    q_t = q.gather(1, target[:, None]).squeeze(1)
    inside = (q_t >= thr.squeeze(1)) & finite
    # a row of -inf logits has no distribution: NaN log-prob and entropy, as the untruncated op and float64
    log_prob = torch.where(inside, q_t - lse, torch.where(finite, NEG_INF, float("nan")))
    entropy = None
    if want_entropy:
        # sum_S p (lse_S - q) on q shifted by the row max: non-negative O(1) terms, no cancellation at large |q|
        top = torch.where(finite, q.amax(dim=1), 0.0)[:, None]
        shifted = q - top
        lse_shifted = torch.logsumexp(shifted.masked_fill(~kept, NEG_INF), dim=1, keepdim=True)
        p = torch.where(kept & finite[:, None], torch.exp(shifted - lse_shifted), 0.0)
        entropy = torch.where(finite, torch.where(p > 0, p * (lse_shifted - shifted), 0.0).sum(dim=1),
                              float("nan"))
    return log_prob, entropy, lse


def _probs(q, kept, lse, finite):
    return torch.where(kept & finite[:, None], torch.exp(q - lse[:, None]), 0.0)


def grad_q(q: torch.Tensor, target: torch.Tensor, thr: torch.Tensor, lse: torch.Tensor, g_log_prob, g_entropy,
           entropy) -> torch.Tensor:
    """The fp32 gradient of ``sum(g_log_prob * log_prob + g_entropy * entropy)`` w.r.t. ``q``, 0 off the kept set."""
    kept = q >= thr
    finite = lse > NEG_INF
    p = _probs(q, kept, lse, finite)
    grad = torch.zeros_like(q)
    if g_log_prob is not None:
        q_t = q.gather(1, target[:, None])
        g = torch.where((q_t >= thr) & finite[:, None], g_log_prob.float()[:, None], 0.0)
        grad -= g * p
        grad.scatter_add_(1, target[:, None], g)
    if g_entropy is not None:
        centered = torch.where(p > 0, q - lse[:, None] + entropy[:, None], 0.0)
        grad -= g_entropy.float()[:, None] * p * centered
    return grad
