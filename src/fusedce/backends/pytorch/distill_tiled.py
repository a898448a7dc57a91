"""``linear_distillation_loss(method="tiled")`` in plain PyTorch: both LM heads and the loss on blocks of
tokens x vocabulary (``tuning.tile_sizes``: fewer than V logits a block), never a tensor of V or more
elements besides the weights, biases and the student's gradients.

Per token block r (the block math is ``distill_rows.py``'s, on vocabulary slices):
    pass 1, per vocabulary block j: x_s = h_s @ W_s[j].T + b_s[j] and x_t likewise (each in its model's dtype,
        fp32 accumulation, as ``F.linear``), then fp32; the online log-sum-exp (Milakov & Gimelshein 2018)
        of u = c(x_s) / T and of c(x_t) / T, of c(x_s) when the hard label needs it at T != 1, and the
        target's c(x_s);
    pass 2: each block again, its log-probabilities from those lse's: the divergence (and for beta > 0
        the row sum ``sum s g`` its gradient needs, ``distill_rows.divergence``); for beta = 0 the
        gradient block too (it needs no row sum);
    pass 3 (gradients with beta > 0): each block again, ``dz`` as ``distill_rows``, then
        grad_h[r] += dz @ W_s[j] (fp32), grad_W[j] += dz.T @ h_s[r] and grad_b[j] += sum_rows dz (fp32).
FLOPs (student H, teacher Ht, per token): 2 V (H + Ht) per pass, plus 4 V H for the gradients.
Memory beyond the inputs and the returned gradients: a few fp32 blocks of fewer than V values, O(BT) row
statistics; for non-fp32 hidden an fp32 ``BT x H`` accumulator of its gradient (as ``tiled.py``). One
thread of Python blocks in a fixed order: deterministic whatever ``deterministic`` says.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import tuning
from .distill_rows import capped, chain, divergence, grad_u
from .tiled import _block_logits, _target_columns

_NEG_INF = float("-inf")


class _Lse:
    """Online log-sum-exp of rows of fp32 blocks."""

    def __init__(self, n: int, device):
        self.m = torch.full((n,), _NEG_INF, device=device)
        self.s = torch.zeros(n, device=device)

    def add(self, u: torch.Tensor) -> None:
        m_new = torch.maximum(self.m, u.amax(dim=1))
        shift = torch.where(m_new == _NEG_INF, 0.0, m_new)   # all -inf so far: shift by 0, never NaN
        self.s = torch.exp(self.m - shift) * self.s + torch.exp(u - shift[:, None]).sum(dim=1)
        self.m = m_new

    def value(self) -> torch.Tensor:
        return torch.where(self.m == _NEG_INF, 0.0, self.m) + torch.log(self.s)


def tiled_distill(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                  target, grad_factor, *, beta: float, temperature: float, hard_label_weight: float,
                  ignore_index: int, student_softcap: Optional[float], teacher_softcap: Optional[float],
                  deterministic: bool = False):
    """Per-row distillation loss of both heads' logits and, with ``grad_factor``, the student's gradients.

    Args:
        student_hidden ``(N, H)``, student_weight ``(V, H)``, student_bias ``(V,)`` or None (one dtype);
        teacher_hidden ``(N, Ht)``, teacher_weight ``(V, Ht)``, teacher_bias ``(V,)`` or None (one dtype);
        target ``(N,)`` int64 or None; grad_factor ``(N,)`` fp32 or None; the options as ``distill_rows``.

    Returns:
        ``(loss_rows, grad_hidden, grad_weight, grad_bias)``: ``loss_rows`` (N,) fp32 (0 on ignored rows);
        with ``grad_factor``: the gradients of ``sum_r grad_factor[r] loss_rows[r]``, grad_hidden in
        ``student_hidden``'s dtype, grad_weight (V, H) and grad_bias (V,) (None without a bias) in fp32
        (the accumulation dtype, as ``tiled.py``); otherwise None, None, None. No tensor of V or more
        elements besides those and the inputs; nothing is written in place.
    """
    hs, ws, bs, ht, wt, bt = student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias
    n, n_classes = hs.shape[0], ws.shape[0]
    dev = hs.device
    want = grad_factor is not None
    loss = torch.zeros(n, device=dev)
    g_h = torch.zeros(hs.shape, dtype=torch.float32, device=dev) if want else None
    g_w = torch.zeros(ws.shape, dtype=torch.float32, device=dev) if want else None
    g_b = torch.zeros(n_classes, dtype=torch.float32, device=dev) if want and bs is not None else None
    fp32 = hs.dtype == torch.float32
    hard = hard_label_weight != 0.0 and target is not None
    inv_t = 1.0 / temperature
    tile_rows, tile_vocab = tuning.tile_sizes(n_classes)

    def blocks(r):
        for v0 in range(0, n_classes, tile_vocab):
            cols = slice(v0, v0 + tile_vocab)
            xs = _block_logits(hs[r], ws, bs, cols)
            cs = capped(xs, student_softcap)
            ut = capped(_block_logits(ht[r], wt, bt, cols), teacher_softcap) * inv_t
            yield v0, cols, cs, (cs if temperature == 1.0 else cs * inv_t), ut

    def _grad_block(ls, lt, cs, rsum, r, cols, v0, t_r, valid, l1, factor):
        hard_blk = None
        if hard:
            hard_blk = hard_label_weight * torch.exp(cs - l1[:, None])
            owned, col = _target_columns(t_r, valid, v0, cs.shape[1])
            hard_blk.scatter_add_(1, col[:, None], torch.where(owned, -hard_label_weight, 0.0)[:, None])
        dz = chain(grad_u(ls, lt, beta, rsum), cs, hard_blk, temperature, student_softcap) * factor[:, None]
        if valid is not None:
            dz = torch.where(valid[:, None], dz, 0.0)
        if not fp32:   # the logits' gradient in their dtype, as the chunked and stock paths
            dz = dz.to(hs.dtype).float()
        w_blk = ws[cols]
        g_h[r].addmm_(dz, w_blk if fp32 else w_blk.float())
        g_w[cols].addmm_(dz.t(), hs[r] if fp32 else hs[r].float())
        if g_b is not None:
            g_b[cols] += dz.sum(dim=0)

    with torch.no_grad():
        for r0 in range(0, n, tile_rows):
            r = slice(r0, r0 + tile_rows)
            m = hs[r].shape[0]
            t_r = None if target is None else target[r]
            valid = None if t_r is None else t_r != ignore_index
            lse_s, lse_t = _Lse(m, dev), _Lse(m, dev)
            lse_1 = _Lse(m, dev) if hard and temperature != 1.0 else None
            c_tgt = torch.zeros(m, device=dev)
            for v0, cols, cs, us, ut in blocks(r):   # pass 1: the row statistics
                lse_s.add(us)
                lse_t.add(ut)
                if lse_1 is not None:
                    lse_1.add(cs)
                if hard:
                    owned, col = _target_columns(t_r, valid, v0, cs.shape[1])
                    c_tgt += torch.where(owned, cs.gather(1, col[:, None])[:, 0], 0.0)
            ls0, lt0 = lse_s.value(), lse_t.value()
            l10 = ls0 if lse_1 is None else lse_1.value()
            factor = None if not want else grad_factor[r].float()
            div = torch.zeros(m, device=dev)
            row_sum = torch.zeros(m, device=dev) if beta != 0.0 else None
            grads_now = want and beta == 0.0
            for v0, cols, cs, us, ut in blocks(r):   # pass 2: the loss (and beta = 0's gradient)
                ls, lt = us - ls0[:, None], ut - lt0[:, None]
                d_div, d_sum = divergence(ls, lt, beta)
                div += d_div
                if row_sum is not None:
                    row_sum += d_sum
                if grads_now:
                    _grad_block(ls, lt, cs, None, r, cols, v0, t_r, valid, l10, factor)
            if want and not grads_now:
                for v0, cols, cs, us, ut in blocks(r):   # pass 3: the gradients (beta > 0)
                    _grad_block(us - ls0[:, None], ut - lt0[:, None], cs, row_sum, r, cols, v0, t_r, valid, l10,
                                factor)
            rows = div
            if t_r is not None:
                if hard:
                    rows = rows + hard_label_weight * (l10 - c_tgt)
                in_range = (t_r >= 0) & (t_r < n_classes)
                rows = torch.where(valid, torch.where(in_range, rows, float("nan")), 0.0)
            loss[r] = rows

    if not want:
        return loss, None, None, None
    return loss, (g_h if fp32 else g_h.to(hs.dtype)), g_w, g_b
