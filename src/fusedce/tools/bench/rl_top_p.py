"""The top-p row of the RL-precision table: ``linear_token_log_probs(..., top_p=TOP_P)`` against a float64
reference of the truncated distribution, written from the contract's rule (docs/internals.md)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .inputs import IGNORE_INDEX

TOP_P = 0.9
MARGIN = 1e-4     # rows with a mass ahead this close to top_p: the kept set is fp32's call (module docstring)
CHUNK = 1 << 22   # float64 logits per reference chunk (32 MiB; a few copies of it live at once)
PATHS = {"fusedce-top-p": f"fusedce linear_token_log_probs(top_p={TOP_P}) vs float64 of the truncated distribution"}


def forward(hidden, weight, target, **options):
    import fusedce
    out = fusedce.linear_token_log_probs(hidden, weight, target, ignore_index=IGNORE_INDEX, return_entropy=True,
                                         top_p=TOP_P, **options)
    return out.log_probs, out.entropy


def reference(x64: torch.Tensor, target: torch.Tensor, top_p: float = TOP_P):
    """float64 ``(log_probs, entropy, margin)`` of the top-p truncated softmax of ``x64`` (n, V) at ``target``
    (n,); ``margin`` (n,): the smallest |mass ahead - top_p| of a row's tie groups; ``keep`` (n, V) bool.
    Any float dtype: fp32 ``x64`` gives the kept set in fp32 arithmetic."""
    values, order = x64.sort(dim=-1, descending=True)
    probs = torch.softmax(values, dim=-1)
    above = probs.cumsum(-1) - probs                       # mass of the classes sorted before
    first = torch.searchsorted(-values, -values, side="left")   # first member of each tie group
    ahead = above.gather(-1, first)
    keep_sorted = ahead < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    q = x64.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(q, dim=-1)
    lp = logp.gather(-1, target.clamp_min(0)[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp.where(keep, 0.0)).sum(-1)
    ignored = target == IGNORE_INDEX
    return lp.where(~ignored, 0.0), ent.where(~ignored, 0.0), (ahead - top_p).abs().amin(-1), keep


def errors(hidden, weight, target, log_probs, entropy, rows) -> dict:
    """``log_probs_max_abs_err``, ``entropy_max_abs_err`` on ``rows`` (module docstring), ``CHUNK`` float64
    elements of logits at a time."""
    step = max(1, CHUNK // weight.shape[0])
    parts = []
    for idx in rows.split(step):
        lp64, ent64, margin, keep64 = reference(F.linear(hidden.detach()[idx].double(), weight.detach().double()),
                                                target[idx])
        keep32 = reference(F.linear(hidden.detach()[idx].float(), weight.detach().float()), target[idx])[3]
        parts.append((lp64, ent64, (margin >= MARGIN) | (keep32 == keep64).all(-1)))
    ref_lp, ref_ent, clear = (torch.cat(p) for p in zip(*parts))
    ref_lp, ref_ent, rows = ref_lp[clear], ref_ent[clear], rows[clear]
    got = log_probs.detach()[rows].double()
    both = torch.isfinite(got) & torch.isfinite(ref_lp)
    lp_err = float((got - ref_lp)[both].abs().max()) if bool(both.any()) else 0.0
    if bool((torch.isfinite(got) != torch.isfinite(ref_lp)).any()):
        lp_err = float("inf")
    ent_err = float((entropy.detach()[rows].double() - ref_ent).abs().max())
    return {"log_probs_max_abs_err": lp_err, "entropy_max_abs_err": ent_err,
            "kept_targets": int(both.sum()), "rows": int(rows.numel()), "boundary_rows": int((~clear).sum()),
            "note": f"{int((~clear).sum())} of {int(clear.numel())} rows whose fp32 kept set differs at a mass "
                    f"ahead within {MARGIN:g} of top_p left out"}
