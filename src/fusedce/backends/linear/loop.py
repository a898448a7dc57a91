"""The chunk loop: logits of ``rows`` tokens at a time, never BT x V.

Per chunk c (hidden rows h_c, n_c x H):
    logits_c = h_c @ W.T (+ b)                       n_c x V, hidden's dtype, fp32 accumulation
    loss_c, lse_c = CE forward(logits_c)              (backend kernel)
    g_c = dloss/dlogits_c, written over logits_c      (backend kernel, in place, times grad_row)
    grad_h_c = g_c @ W;  grad_W += g_c.T @ h_c;  grad_b += sum_rows g_c   (accum_dtype accumulators)
FLOPs: 2 n_c V H for the logits and 2 n_c V H for each of grad_h and grad_W, as the unfused path.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...types import LossOptions

_OUT_DTYPE_MM: dict = {}


def logits_chunk(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``h @ weight.T (+ bias)`` in ``h``'s dtype (as ``F.linear`` on that device)."""
    return torch.nn.functional.linear(h, weight, bias)


def _mm_out_dtype_ok(device: torch.device) -> bool:
    """Whether ``torch.addmm(..., out_dtype=)`` runs here (CUDA builds; not the CPU kernels)."""
    key = device.type
    if key not in _OUT_DTYPE_MM:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            acc = torch.zeros(2, 2, dtype=torch.float32, device=device)
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _OUT_DTYPE_MM[key] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE_MM[key] = False
    return _OUT_DTYPE_MM[key]


def accumulate_(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``acc += g.T @ h`` with ``acc`` in its own (accumulation) dtype, no fresh V x H temporary."""
    if acc.dtype == g.dtype:
        acc.addmm_(g.t(), h)
    elif _mm_out_dtype_ok(acc.device):
        torch.addmm(acc, g.t(), h, out_dtype=acc.dtype, out=acc)
    else:  # upcast the chunk operands (n_c x V and n_c x H), never the V x H result
        acc.addmm_(g.t().to(acc.dtype), h.to(acc.dtype))


def loss_only(ce, hidden, weight, bias, target, w, w_sum, opts: LossOptions, rows: int, stats: bool):
    """Per-row ``(loss, lse, predicted)`` for every token; no gradient buffers at all."""
    n = hidden.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(loss)
    predicted = torch.full((n,), -1, dtype=torch.int64, device=hidden.device)
    for s in range(0, n, rows):
        c = slice(s, s + rows)
        loss_c, lse_c, pred_c = ce.loss(logits_chunk(hidden[c], weight, bias), target[c], w, w_sum, opts, stats)
        loss[c], lse[c] = loss_c, lse_c
        if stats:
            predicted[c] = pred_c
    return loss, lse, predicted


def grads(ce, hidden, weight, bias, target, w, w_sum, opts: LossOptions, rows: int, grad_row,
          needs, accum_dtype, lse=None, stats: bool = False):
    """Gradients of ``sum_i grad_row[i] * loss_i`` (and, when ``lse`` is None, the forward too).

    ``grad_row``: (n,) per-row upstream gradient (any strides). ``needs``: which of (hidden, weight,
    bias) need a gradient. ``lse`` given: the forward is not recomputed (the backward of "none").
    Returns ``(loss, lse, predicted, grad_hidden, grad_weight, grad_bias)``; loss/predicted are None when
    ``lse`` was given; grad_weight / grad_bias are in ``accum_dtype``.
    """
    n = hidden.shape[0]
    forward = lse is None
    if forward:
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(loss)
        predicted = torch.full((n,), -1, dtype=torch.int64, device=hidden.device)
    else:
        loss = predicted = None
    grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if needs[0] else None
    grad_w = torch.zeros(weight.shape, dtype=accum_dtype, device=weight.device) if needs[1] else None
    grad_b = torch.zeros(weight.shape[0], dtype=accum_dtype, device=weight.device) if needs[2] else None
    for s in range(0, n, rows):
        c = slice(s, s + rows)
        h_c = hidden[c]
        logits = logits_chunk(h_c, weight, bias)
        if forward:
            loss[c], lse[c], pred_c = ce.loss(logits, target[c], w, w_sum, opts, stats)
            if stats:
                predicted[c] = pred_c
        ce.grad_(logits, target[c], w, w_sum, lse[c], grad_row[c], opts)
        if grad_h is not None:
            torch.mm(logits, weight, out=grad_h[c])
        if grad_w is not None:
            accumulate_(grad_w, logits, h_c)
        if grad_b is not None:
            grad_b += logits.sum(dim=0, dtype=accum_dtype)
        del logits   # free this chunk before the next one is allocated: one chunk alive, not two
    return loss, lse, predicted, grad_h, grad_w, grad_b
