"""The float64 oracle of the distillation tests, written from the formulas (nothing here imports fusedce).

Per token, with ``c(x) = cap * tanh(x / cap)`` (softcap, per model, when given), ``T`` the temperature,
``s = softmax(c(z_s) / T)`` and ``t = softmax(c(z_t) / T)`` over the vocabulary:

- ``beta == 0``: ``KL(t || s) = sum_v t_v (log t_v - log s_v)`` (forward KL);
- ``beta == 1``: ``KL(s || t) = sum_v s_v (log s_v - log t_v)`` (reverse KL);
- otherwise the generalized Jensen-Shannon divergence of GKD (arXiv 2306.13649, Eq. 1, in TRL's
  ``generalized_jsd_loss`` form): ``beta KL(t || m) + (1 - beta) KL(s || m)``, ``m = beta t + (1 - beta) s``;

plus ``hard_label_weight * CE(c(z_s), target)`` (the student's own cross-entropy, NOT at the temperature).
Terms with a zero probability contribute 0 (``0 log 0 = 0``). Rows whose target is ``ignore_index``
contribute 0. ``"mean"`` divides the sum by ``num_items_in_batch`` if given, else by the number of
non-ignored rows (all rows when no target), a zero denominator giving 0. Gradients come from float64
autograd through this composition (the teacher is a constant).
"""
from __future__ import annotations

from typing import Optional, Union

import torch


def _cap(z: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    return z if cap is None else cap * torch.tanh(z / cap)


def _plogp_minus(p: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """sum_v p_v (log p_v - log q_v) with 0 where p_v == 0 (no NaN from -inf logs)."""
    pos = p > 0
    term = torch.where(pos, p * (torch.where(pos, log_p, 0.0) - torch.where(pos, log_q, 0.0)), 0.0)
    return term.sum(-1)


def distill_rows64(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                   target: Optional[torch.Tensor] = None, *, beta: float = 0.0, temperature: float = 1.0,
                   hard_label_weight: float = 0.0, ignore_index: int = -100,
                   student_softcap: Optional[float] = None,
                   teacher_softcap: Optional[float] = None) -> torch.Tensor:
    """Per-row loss, float64, shape ``student_logits.shape[:-1]`` (0 on ignored rows).

    ``student_logits`` may require grad (it is upcast with autograd kept); ``teacher_logits`` is detached.
    """
    zs = _cap(student_logits.double(), student_softcap)
    zt = _cap(teacher_logits.detach().double(), teacher_softcap)
    ls = torch.log_softmax(zs / temperature, dim=-1)
    lt = torch.log_softmax(zt / temperature, dim=-1)
    s, t = ls.exp(), lt.exp()
    if beta == 0.0:
        div = _plogp_minus(t, lt, ls)
    elif beta == 1.0:
        div = _plogp_minus(s, ls, lt)
    else:
        m = beta * t + (1.0 - beta) * s
        lm = torch.log(m)
        div = beta * _plogp_minus(t, lt, lm) + (1.0 - beta) * _plogp_minus(s, ls, lm)
    rows = div
    if target is not None:
        valid = target != ignore_index
        if hard_label_weight != 0.0:
            lsm = torch.log_softmax(zs, dim=-1)
            safe = torch.where(valid, target, 0).long()
            ce = -lsm.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
            rows = rows + hard_label_weight * ce
        rows = torch.where(valid, rows, torch.zeros((), dtype=rows.dtype))
    return rows


def distillation_loss64(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                        target: Optional[torch.Tensor] = None, *, reduction: str = "mean",
                        num_items_in_batch: Union[int, torch.Tensor, None] = None,
                        ignore_index: int = -100, **kw) -> torch.Tensor:
    """The reduced float64 loss (see the module docstring for the mean's denominator)."""
    rows = distill_rows64(student_logits, teacher_logits, target, ignore_index=ignore_index, **kw)
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "sum":
        return total
    if num_items_in_batch is not None:
        d = float(num_items_in_batch)
    elif target is not None:
        d = float((target != ignore_index).sum())
    else:
        d = float(rows.numel())
    return total / d if d != 0 else total * 0.0


def linear_distillation_loss64(student_hidden, student_weight, teacher_hidden, teacher_weight,
                               target=None, *, student_bias=None, teacher_bias=None, **kw) -> torch.Tensor:
    """``distillation_loss64`` of ``h_s @ W_s.T + b_s`` and ``h_t @ W_t.T + b_t`` in float64 (student
    tensors keep autograd, so ``.backward()`` gives the float64 student gradients)."""
    zs = student_hidden.double() @ student_weight.double().T
    if student_bias is not None:
        zs = zs + student_bias.double()
    with torch.no_grad():
        zt = teacher_hidden.double() @ teacher_weight.double().T
        if teacher_bias is not None:
            zt = zt + teacher_bias.double()
    return distillation_loss64(zs, zt, target, **kw)
