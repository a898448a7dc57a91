"""Float64 references for the bench, compared chunk by chunk."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .inputs import row_slice

CHUNK_ELEMENTS = 1 << 22         # 32 MiB per float64 chunk
LINEAR_CHUNK_ELEMENTS = 1 << 24  # 128 MiB per float64 chunk of logits (341 rows at V = 49152)


class ErrorStats:
    """Accumulates the error of a gradient against its reference over chunks."""

    def __init__(self) -> None:
        self.max_abs, self.diff_sq, self.ref_sq = 0.0, 0.0, 0.0

    def add(self, grad: torch.Tensor, ref: torch.Tensor) -> None:
        diff = grad.double() - ref
        self.max_abs = max(self.max_abs, float(diff.abs().max())) if diff.numel() else self.max_abs
        self.diff_sq += float(diff.square().sum())
        self.ref_sq += float(ref.square().sum())

    def rel(self) -> float:
        if self.ref_sq == 0.0:
            return 0.0 if self.diff_sq == 0.0 else math.inf
        return math.sqrt(self.diff_sq / self.ref_sq)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor,
                  grad: torch.Tensor, ignore_index: int = -100) -> dict:
    """Compare a mean cross-entropy ``loss`` and its ``grad`` (BT, V) on ``logits`` (BT, V) with float64
    ``F.cross_entropy`` on the upcast logits, chunk by chunk (no non-ignored row: reference 0, as the contract)."""
    n_valid = int((target != ignore_index).sum())
    step = max(1, CHUNK_ELEMENTS // max(1, logits.shape[1]))
    total, stats = 0.0, ErrorStats()
    for start in range(0, logits.shape[0], step):
        rows = slice(start, start + step)
        x = logits[rows].detach().double().requires_grad_(True)
        chunk_sum = F.cross_entropy(x, target[rows], ignore_index=ignore_index, reduction="sum")
        (ref,) = torch.autograd.grad(chunk_sum, x)
        total += float(chunk_sum.detach())
        stats.add(grad[rows], ref / max(n_valid, 1))
    loss_ref = total / n_valid if n_valid else 0.0
    return {
        "loss": float(loss), "loss_ref": loss_ref, "loss_abs_err": abs(float(loss) - loss_ref),
        "grad_max_abs_err": stats.max_abs, "grad_rel_err": stats.rel(), "scored_rows": n_valid,
    }


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         loss: torch.Tensor, grads: dict, ignore_index: int = -100) -> dict:
    """Compare a mean ``loss`` of ``hidden`` (BT, H) @ ``weight`` (V, H).T and its ``grads["hidden"]`` /
    ``grads["weight"]`` with float64 ``F.cross_entropy(F.linear(h, W))`` on the upcast tensors, per row chunk."""
    n_valid = int((target != ignore_index).sum())
    denominator = max(n_valid, 1)
    weight64 = weight.detach().double().requires_grad_(True)
    ref_weight = torch.zeros_like(weight64)
    step = max(1, LINEAR_CHUNK_ELEMENTS // max(1, weight.shape[0]))
    total, stats_h = 0.0, ErrorStats()
    valid = (target != ignore_index).nonzero().squeeze(1)
    ignored = (target == ignore_index).nonzero().squeeze(1)
    grad_h = grads["hidden"]
    for start in range(0, valid.shape[0], step):
        rows = valid[start:start + step]
        x = hidden.detach()[rows].double().requires_grad_(True)
        chunk_sum = F.cross_entropy(F.linear(x, weight64), target[rows], reduction="sum")
        ref_x, ref_w = torch.autograd.grad(chunk_sum, (x, weight64))
        total += float(chunk_sum.detach())
        ref_weight += ref_w
        stats_h.add(grad_h[rows], ref_x / denominator)
    if ignored.numel():
        stats_h.add(grad_h[ignored], torch.zeros(ignored.shape[0], hidden.shape[1], dtype=torch.float64,
                                                 device=hidden.device))
    stats_w, w_step = ErrorStats(), max(1, CHUNK_ELEMENTS // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], w_step):
        rows = slice(start, start + w_step)
        stats_w.add(grads["weight"][rows], ref_weight[rows] / denominator)
    loss_ref = total / n_valid if n_valid else 0.0
    per_leaf = {name: {"max_abs_err": s.max_abs, "rel_err": s.rel()}
                for name, s in (("hidden", stats_h), ("weight", stats_w))}
    return {
        "loss": float(loss), "loss_ref": loss_ref, "loss_abs_err": abs(float(loss) - loss_ref),
        "grad_max_abs_err": max(s["max_abs_err"] for s in per_leaf.values()),
        "grad_rel_err": max(s["rel_err"] for s in per_leaf.values()), "grads": per_leaf,
        "scored_rows": n_valid,
    }


def subset_rows(target: torch.Tensor, n: Optional[int], ignore_index: int = -100) -> torch.Tensor:
    """Indices of ``n`` rows spread evenly over ``target`` (``inputs.row_slice``; None or ``n >= BT``: every row), on
    ``target``'s device."""
    n_rows = target.shape[0]
    rows = row_slice(n_rows, n)
    rows = torch.arange(n_rows) if rows is None else rows.clone()
    ignored = (target.cpu() == ignore_index)
    picked = ignored[rows]
    if ignored.any() and not picked.any():
        rows[-1] = int(ignored.nonzero()[0])
    elif (~ignored).any() and picked.all():
        rows[0] = int((~ignored).nonzero()[0])
    return rows.unique().to(target.device)


def _ratio(ours: float, theirs: float) -> float:
    if theirs > 0:
        return ours / theirs
    return 0.0 if ours == 0 else math.inf


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, row_loss: torch.Tensor, grad: torch.Tensor,
                       rows: Optional[torch.Tensor] = None, ignore_index: int = -100,
                       mean: Optional[torch.Tensor] = None) -> dict:
    """Per-row losses ``row_loss`` (BT,) and ``grad`` (BT, V) on ``rows`` against float64 ``F.cross_entropy``, next to
    torch's own error in the logits' dtype; returns the error fields and their ratio (docs/internals.md)."""
    rows = torch.arange(logits.shape[0], device=logits.device) if rows is None else rows.to(logits.device)
    step = max(1, CHUNK_ELEMENTS // max(1, logits.shape[1]))
    loss_diff = loss_ref = grad_err = torch_err = 0.0
    for start in range(0, rows.shape[0], step):
        idx = rows[start:start + step]
        t = target[idx]
        ref_x = logits[idx].detach().double().requires_grad_(True)
        ref = F.cross_entropy(ref_x, t, reduction="none", ignore_index=ignore_index)
        (ref_grad,) = torch.autograd.grad(ref.sum(), ref_x)
        own_x = logits[idx].detach().clone().requires_grad_(True)     # torch in the logits' own dtype
        own = F.cross_entropy(own_x, t, reduction="none", ignore_index=ignore_index)
        (own_grad,) = torch.autograd.grad(own.sum(), own_x)
        ref = ref.detach()
        loss_diff = max(loss_diff, float((row_loss[idx].double() - ref).abs().max()))
        loss_ref = max(loss_ref, float(ref.abs().max()))
        grad_err = max(grad_err, float((grad[idx].double() - ref_grad).abs().max()))
        torch_err = max(torch_err, float((own_grad.double() - ref_grad).abs().max()))
    out = dict(loss_rel_err_vs_fp64=loss_diff / max(loss_ref, 1e-30), grad_err_vs_fp64=grad_err,
               torch_grad_err_vs_fp64=torch_err, grad_err_ratio=_ratio(grad_err, torch_err),
               rows=int(rows.shape[0]))
    if mean is not None:
        mean32 = F.cross_entropy(logits.detach().float(), target, ignore_index=ignore_index)
        out = dict(mean_rel_err_vs_fp32=float((mean.detach().float() - mean32).abs() / mean32.abs()), **out)
    return out


def linear_token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                           log_probs: torch.Tensor, entropy: Optional[torch.Tensor],
                           rows: Optional[torch.Tensor] = None, ignore_index: int = -100,
                           temperature: float = 1.0) -> dict:
    """Per-token ``log_probs`` and ``entropy`` of ``hidden @ weight.T`` on ``rows`` against float64, next to torch's
    own error (``F.linear`` in the inputs' dtype, then fp32 ``log_softmax``); returns the error fields."""
    rows = torch.arange(hidden.shape[0], device=hidden.device) if rows is None else rows.to(hidden.device)
    weight64 = weight.detach().double()
    step = max(1, LINEAR_CHUNK_ELEMENTS // max(1, weight.shape[0]))
    err = dict(lp=0.0, torch_lp=0.0, ent=0.0, torch_ent=0.0)

    def stats(logits):
        logp = torch.log_softmax(logits / temperature, dim=-1)
        lp = logp.gather(1, t.clamp_min(0)[:, None]).squeeze(1).where(keep, 0.0)
        return lp, (-(logp.exp() * logp).sum(-1)).where(keep, 0.0)

    for start in range(0, rows.shape[0], step):
        idx = rows[start:start + step]
        t = target[idx]
        keep = t != ignore_index
        x = hidden.detach()[idx]
        ref_lp, ref_ent = stats(F.linear(x.double(), weight64))
        own_lp, own_ent = stats(F.linear(x, weight.detach()).float())
        err["lp"] = max(err["lp"], float((log_probs.detach()[idx].double() - ref_lp).abs().max()))
        err["torch_lp"] = max(err["torch_lp"], float((own_lp.double() - ref_lp).abs().max()))
        if entropy is not None:
            err["ent"] = max(err["ent"], float((entropy.detach()[idx].double() - ref_ent).abs().max()))
            err["torch_ent"] = max(err["torch_ent"], float((own_ent.double() - ref_ent).abs().max()))
    has_ent = entropy is not None
    return dict(log_probs_max_abs_err=err["lp"], torch_log_probs_max_abs_err=err["torch_lp"],
                entropy_max_abs_err=err["ent"] if has_ent else None,
                torch_entropy_max_abs_err=err["torch_ent"] if has_ent else None, rows=int(rows.shape[0]))
