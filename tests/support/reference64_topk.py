"""The float64 oracle of the top-k teacher (``topk_distillation_loss``, ``tail`` False or True), written
from the formula (nothing here imports fusedce).

Per token, with ``z = c(a x)`` (``a`` the logit scale, ``c(y) = cap * tanh(y / cap)`` the softcap when
given), ``s = softmax(z / T)`` over the V classes, the teacher's kept entries ``k`` (not ``-inf``, id not
``ignore_index``, the token not ignored), ``p_k = exp(teacher_log_probs_k)`` as stored:

    loss = sum_k p_k (log p_k - log s[id_k])
         + [tail] p_tail (log p_tail - log s_tail)          (0 when p_tail = 0)
         + hard_label_weight * CE(z, target)                (no temperature)

    p_tail = max(0, 1 - sum_k p_k),   s_tail = 1 - sum_{c in S} s_c = sum_{c not in S} s_c

``S`` the SET of the kept ids (a duplicated id is one class: the student's tail is its mass outside the
K classes; the contract's ``1 - sum_k s[id_k]`` is this when the ids are distinct). ``s_tail`` is taken
here as the float64 sum over the classes outside ``S`` (equal to ``1 - sum`` up to float64 rounding,
and exact also when the K classes hold all but 1e-12 of the mass). A token whose kept ids cover all V
classes has an empty tail on both sides: its tail term is 0. Gradients from float64 autograd.
"""
from __future__ import annotations

from typing import Optional

import torch


def student_log_softmax64(x64: torch.Tensor, temperature: float, softcap: Optional[float],
                          logit_scale: float = 1.0) -> torch.Tensor:
    z = x64 * logit_scale
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    return torch.log_softmax(z / temperature, dim=-1)


def kept64(ids: torch.Tensor, lp: torch.Tensor, target: Optional[torch.Tensor], ignore_index: int = -100):
    keep = (lp != float("-inf")) & (ids != ignore_index)
    if target is not None:
        keep = keep & (target != ignore_index)[..., None]
    return keep


def members64(shape, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(..., V) bool: the classes of the set S of kept ids (a count per class, non-kept entries add 0)."""
    counts = torch.zeros(shape, dtype=torch.long).scatter_add_(-1, torch.where(keep, ids, 0), keep.long())
    return counts > 0


def log_tail64(log_s: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``log s_tail`` per token: the float64 log-sum-exp of ``log s`` over the classes outside S."""
    return torch.logsumexp(torch.where(members64(log_s.shape, ids, keep), float("-inf"), log_s), dim=-1)


def topk_rows64(x64, ids, lp, target=None, *, temperature=1.0, hard_label_weight=0.0, softcap=None,
                logit_scale=1.0, tail=False, ignore_index=-100) -> torch.Tensor:
    """float64 per-token loss of the module docstring; 0 on ignored tokens."""
    ids = ids.long()
    log_s = student_log_softmax64(x64, temperature, softcap, logit_scale)
    lp64 = lp.double()
    keep = kept64(ids, lp, target, ignore_index)
    s_k = log_s.gather(-1, torch.where(keep, ids, 0))
    rows = torch.where(keep, lp64.exp() * (torch.where(keep, lp64, 0.0) - s_k), 0.0).sum(-1)
    if tail:
        p_tail = (1.0 - torch.where(keep, lp64.exp(), 0.0).sum(-1)).clamp(min=0.0)
        empty = members64(log_s.shape, ids, keep).all(-1)
        log_st = log_tail64(log_s, ids, keep)
        live = (p_tail > 0) & ~empty
        safe = torch.where(live, p_tail, 1.0)
        rows = rows + torch.where(live, safe * (safe.log() - torch.where(live, log_st, 0.0)), 0.0)
    if target is None:
        return rows
    valid = target != ignore_index
    if hard_label_weight:
        z = student_log_softmax64(x64, 1.0, softcap, logit_scale)
        rows = rows - hard_label_weight * z.gather(-1, torch.where(valid, target, 0)[..., None])[..., 0]
    return torch.where(valid, rows, 0.0)


def reduce64(rows, target, reduction, num_items=None, ignore_index=-100):
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    d = num_items if num_items is not None else (
        rows.numel() if target is None else int((target != ignore_index).sum()))
    return rows.sum() / d if d else rows.sum() * 0.0
