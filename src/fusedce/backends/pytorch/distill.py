"""Distillation row op of the PyTorch backend: per-row loss and student-logit gradient (``distill_rows``), and the fp32
block math it shares with the tiled op (``distill_tiled.py``)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .launch import run
from .tuning import cpu_block_rows

# Rows per block of ``distill_rows`` off the CPU: about this many fp32 values per temporary (8 MiB), whatever
# BT (the CPU takes ``tuning.cpu_block_rows``).
BLOCK_ELEMENTS = 1 << 21


def capped(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (fp32), or ``x`` without a softcap."""
    return x if cap is None else cap * torch.tanh(x / cap)


def _masked_sum(p: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
    """``sum_v p_v diff_v`` over the classes with ``p_v != 0`` (``0 * inf`` is 0 there; a NaN ``p``, from a
    NaN or +inf logit, keeps its NaN: never a silent 0)."""
    return torch.where(p != 0, p * diff, 0.0).sum(dim=1)


def divergence(ls: torch.Tensor, lt: torch.Tensor, beta: float):
    """``(div, row_sum)`` of fp32 ``(n, v)`` log-probability blocks (a block may be a vocabulary slice:
    every quantity here is a sum over classes): ``div`` the block's part of the divergence, ``row_sum`` its
    part of ``sum s g`` (None for ``beta = 0``, whose gradient needs none)."""
    s, t = ls.exp(), lt.exp()
    if beta == 0.0:
        return _masked_sum(t, lt - ls), None
    if beta == 1.0:
        kl = _masked_sum(s, ls - lt)
        return kl, kl
    lm = log_mixture(ls, lt, beta)
    kl_s = _masked_sum(s, ls - lm)
    return beta * _masked_sum(t, lt - lm) + (1.0 - beta) * kl_s, (1.0 - beta) * kl_s


def log_mixture(ls: torch.Tensor, lt: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(beta t + (1 - beta) s)`` from the log-probabilities, for ``0 < beta < 1``."""
    return torch.logaddexp(lt + math.log(beta), ls + math.log1p(-beta))


def grad_u(ls: torch.Tensor, lt: torch.Tensor, beta: float, row_sum: Optional[torch.Tensor]) -> torch.Tensor:
    """``dL/du`` of the divergence (fp32 ``(n, v)``); ``row_sum`` = the whole row's ``sum s g``."""
    s = ls.exp()
    if beta == 0.0:
        return s - lt.exp()
    g = ls - lt if beta == 1.0 else (1.0 - beta) * (ls - log_mixture(ls, lt, beta))
    return torch.where(s > 0, s * (g - row_sum[:, None]), 0.0)


def chain(du: torch.Tensor, c: torch.Tensor, hard: Optional[torch.Tensor], temperature: float,
          cap: Optional[float]) -> torch.Tensor:
    """``dL/dz_s`` (fp32) from ``dL/du`` (``du``), the hard-label part w.r.t. ``c`` (``hard`` or None)
    and the softcapped student logits ``c``."""
    d = du if temperature == 1.0 else du * (1.0 / temperature)
    if hard is not None:
        d = d + hard
    if cap is not None:
        th = c * (1.0 / cap)   # tanh(x / cap)
        d = d * (1.0 - th * th)
    return d


def distill_rows(student_logits: torch.Tensor, teacher_logits: torch.Tensor, target: Optional[torch.Tensor],
                 grad_factor: Optional[torch.Tensor], *, beta: float, temperature: float, hard_label_weight: float,
                 ignore_index: int, student_softcap: Optional[float], teacher_softcap: Optional[float]):
    """Per-row distillation loss and, with ``grad_factor`` ((N,) fp32), the student logits' gradient: logits (N, V)
    of any float dtypes (never written), ``target`` (N,) int64 or None, the checked options of
    :func:`fusedce.distillation_loss`. Returns ``(loss_rows (N,) fp32, grad (N, V) in the student's dtype or
    None)``, 0 on ignored rows."""
    n, n_classes = student_logits.shape
    dev = student_logits.device
    loss = torch.empty(n, dtype=torch.float32, device=dev)
    grad = None
    if grad_factor is not None:
        grad = torch.empty((n, n_classes), dtype=student_logits.dtype, device=dev)
    # CPU: cache-sized blocks shared among Python threads with one intra-op thread each (``launch.
    # for_row_blocks``' scheme: every row reduced whole by one thread, so its bits do not depend on the rows
    # beside it, ``batch_invariant``); elsewhere ``BLOCK_ELEMENTS``-value blocks in the calling thread.
    cpu = dev.type == "cpu"
    step = cpu_block_rows(n_classes) if cpu else max(1, BLOCK_ELEMENTS // max(1, n_classes))
    n_blocks = -(-n // step)

    def share(k: int, workers: int) -> None:
        for b in range(k, n_blocks, workers):
            r = slice(b * step, b * step + step)
            t_r = None if target is None else target[r]
            loss[r], d = _block(student_logits[r].float(), teacher_logits[r].float(), t_r,
                                None if grad_factor is None else grad_factor[r], beta, temperature,
                                hard_label_weight, ignore_index, student_softcap, teacher_softcap)
            if grad is not None:
                grad[r] = d

    run(share, n_blocks, dev)
    return loss, grad


def _block(xs, xt, target, grad_factor, beta, temperature, hard_label_weight, ignore_index, s_cap, t_cap):
    cs = capped(xs, s_cap)
    ls = torch.log_softmax(cs if temperature == 1.0 else cs * (1.0 / temperature), dim=1)
    lt = torch.log_softmax(capped(xt, t_cap) * (1.0 / temperature), dim=1)
    div, row_sum = divergence(ls, lt, beta)
    rows, hard = div, None
    if target is not None:
        valid = target != ignore_index
        in_range = (target >= 0) & (target < xs.shape[1])
        safe = torch.where(valid & in_range, target, 0).long()[:, None]
        if hard_label_weight != 0.0:
            l1 = ls if temperature == 1.0 else torch.log_softmax(cs, dim=1)
            rows = rows - hard_label_weight * l1.gather(1, safe)[:, 0]
            if grad_factor is not None:
                hard = hard_label_weight * l1.exp()
                hard.scatter_add_(1, safe, torch.full_like(safe, -hard_label_weight, dtype=hard.dtype))
        rows = torch.where(valid, torch.where(in_range, rows, float("nan")), 0.0)
    if grad_factor is None:
        return rows, None
    d = chain(grad_u(ls, lt, beta, row_sum), cs, hard, temperature, s_cap) * grad_factor[:, None]
    if target is not None:
        d = torch.where(valid[:, None], d, 0.0)
    return rows, d
