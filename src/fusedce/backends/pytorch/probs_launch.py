"""Probability ("soft") targets in PyTorch: the row math and its chunk loops (``launch.py``'s ``for_row_blocks`` /
``grad_chunks_``), which ``probs_targets.py`` calls as torch custom ops."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.options import LossOptions
from fusedce.core.row_math import logsumexp_rows, mul_slope_, transform
from .launch import for_row_blocks, grad_chunks_

Opt = Optional[torch.Tensor]
Tensor = torch.Tensor


def mixed_target(q: Tensor, weight: Opt, opts: LossOptions) -> Tensor:
    """``u = w * ((1 - eps) q + eps / V)`` of a block of targets ``q`` ((n, V) any float dtype), a new
    fp32 (n, V) tensor (never ``q`` itself)."""
    eps = opts.label_smoothing
    u = q.float() * (1.0 - eps) + eps / q.shape[1] if eps > 0.0 else q.to(torch.float32, copy=True)
    return u if weight is None else u.mul_(weight)


def probs_rows_forward(x: Tensor, q: Tensor, weight: Opt, opts: LossOptions, stats: bool, scratch: Opt = None):
    """``(loss, lse, lse_lo, a, predicted)`` of fp32 logits ``x`` and targets ``q`` ((n, V)): fp32 (n,)
    each (``a`` = A above), predicted the int64 argmax of ``x`` (lowest index on ties) or None."""
    z = transform(x, opts)
    lse, lse_lo = logsumexp_rows(z, scratch)
    u = mixed_target(q, weight, opts)
    nll = torch.sub(lse[:, None], z, out=scratch).add_(lse_lo[:, None])   # -log p, exact near the max
    loss = torch.where(u == 0.0, 0.0, nll.mul_(u)).sum(dim=1)
    return loss, lse, lse_lo, u.sum(dim=1), x.argmax(dim=1) if stats else None


def probs_rows_grad(x: Tensor, q: Tensor, weight: Opt, lse: Tensor, lse_lo: Tensor, a: Tensor, grad_row: Tensor,
                   grad_lse: Opt, opts: LossOptions, out: Tensor) -> Tensor:
    """``dL/dx`` of fp32 logits ``x`` ((n, V)) into ``out`` (fp32 (n, V), may be ``x``): ``(g A + h) p -
    g u``, times ``dz/dx``; exactly 0 where ``p = u = 0``."""
    z = transform(x, opts)
    g = grad_row.float()
    factor = g * a if grad_lse is None else g * a + grad_lse.float()
    u = mixed_target(q, weight, opts).mul_(g[:, None])
    grad = torch.sub(z, lse[:, None], out=out).sub_(lse_lo[:, None]).exp_().mul_(factor[:, None]).sub_(u)
    return mul_slope_(grad, z, opts)


def probs_chunk_loss(logits: Tensor, q: Tensor, w: Opt, opts: LossOptions, stats: bool):
    """Per-row ``(loss, lse, lse_lo, a, predicted)`` of ``logits`` / ``q`` ((n, V)) in row chunks
    (``tuning.chunk_rows``), fp32 temporaries of one chunk at a time; predicted None without stats."""
    n_rows = logits.shape[0]
    out = [logits.new_empty(n_rows, dtype=torch.float32) for _ in range(4)]
    predicted = logits.new_empty(n_rows, dtype=torch.int64) if stats else None
    def each(rows, block, work):
        res = probs_rows_forward(block, q[rows], w, opts, stats, work)
        for dst, src in zip(out, res):
            dst[rows] = src
        if stats:
            predicted[rows] = res[4]

    for_row_blocks(logits, each)
    return (*out, predicted)


def probs_chunk_grad_(logits: Tensor, q: Tensor, w: Opt, lse: Tensor, lse_lo: Tensor, a: Tensor, grad_row: Tensor,
                     grad_lse: Opt, opts: LossOptions, out: Opt = None) -> Tensor:
    """Write the gradient into ``out`` (default ``logits`` itself), chunk by chunk."""
    def row_grad(rows, block, buf):
        return probs_rows_grad(block, q[rows], w, lse[rows], lse_lo[rows], a[rows], grad_row[rows],
                              None if grad_lse is None else grad_lse[rows], opts, buf)

    return grad_chunks_(logits, logits if out is None else out, row_grad)
