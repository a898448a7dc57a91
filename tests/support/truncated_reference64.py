"""Float64 reference of the sampler's truncated distribution (top-k then top-p, renormalized), written
independently of ``fusedce/rl/truncated_rows.py``: the kept set from pairwise comparisons (no sort, no
threshold), the values and gradients from float64 autograd on the kept set (the set held fixed)."""
from typing import Optional

import torch


def transform64(x: torch.Tensor, temperature: float, softcap: Optional[float]) -> torch.Tensor:
    z = x if softcap is None else softcap * torch.tanh(x / softcap)
    return z / temperature


def kept_set(q: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """Bool (V,) of one row: classes with fewer than k classes strictly above (the >= k-th largest rule),
    then classes whose mass strictly above (under the top-k renormalization) is < p."""
    above = (q[None, :] > q[:, None])   # above[i, j]: q_j > q_i
    keep = torch.ones_like(q, dtype=torch.bool)
    if k:
        keep = above.sum(dim=1) < k   # i is >= the k-th largest iff fewer than k classes are larger
    if p < 1.0:
        probs = torch.softmax(q.masked_fill(~keep, float("-inf")), dim=0)
        larger = (above & keep[None, :]).double() @ probs
        keep = keep & (larger < p)
    return keep


def reference(x: torch.Tensor, target: torch.Tensor, top_k, top_p, temperature=1.0, softcap=None,
              ignore_index=-100):
    """``(log_probs, entropy)`` float64 of ``x`` (n, V) and ``target`` (n,), differentiable in ``x`` (a float64
    leaf the caller made); ``top_k`` / ``top_p`` (n,) lists. -inf (constant) for a target outside its set."""
    lps, ents = [], []
    for i in range(x.shape[0]):
        if int(target[i]) == ignore_index:
            lps.append(x.new_zeros(()))
            ents.append(x.new_zeros(()))
            continue
        q = transform64(x[i], temperature, softcap)
        with torch.no_grad():
            keep = kept_set(q, int(top_k[i]), float(top_p[i]))
        logp = torch.log_softmax(q.masked_fill(~keep, float("-inf")), dim=0)
        t = int(target[i])
        lps.append(logp[t] if keep[t] else x.new_tensor(float("-inf")))
        ents.append(-(logp.exp() * torch.where(keep, logp, 0.0)).sum())
    return torch.stack(lps), torch.stack(ents)
