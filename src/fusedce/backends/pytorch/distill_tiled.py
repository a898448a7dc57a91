"""``linear_distillation_loss(method="tiled")`` in plain PyTorch: both heads and the loss on token x vocabulary
blocks, never a tensor of V elements besides the heads'."""
from __future__ import annotations

from typing import Optional

import torch

from . import launch, tuning
from .distill import capped, chain, divergence, grad_u
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


def _block_logits_pair(hs, ws, bs, ht, wt, bt, r, cols, s_cap, t_cap, inv_t, temperature):
    """``(cs, us, ut)`` of a token and vocabulary block: the student's capped logits and both at T (fp32)."""
    cs = capped(_block_logits(hs[r], ws, bs, cols), s_cap)
    ut = capped(_block_logits(ht[r], wt, bt, cols), t_cap) * inv_t
    return cs, (cs if temperature == 1.0 else cs * inv_t), ut


def tiled_distill(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                  target, grad_factor, *, beta: float, temperature: float, hard_label_weight: float,
                  ignore_index: int, student_softcap: Optional[float], teacher_softcap: Optional[float],
                  deterministic: bool = False, batch_invariant: bool = False):
    """Per-row loss (N,) fp32 and, with ``grad_factor``, the student's ``(grad_hidden, grad_weight, grad_bias)``
    (None without); no tensor of V or more elements."""
    hs, ws, bs = student_hidden, student_weight, student_bias
    n, n_classes = hs.shape[0], ws.shape[0]
    dev = hs.device
    hard = hard_label_weight != 0.0 and target is not None
    inv_t = 1.0 / temperature
    tile_rows, tile_vocab = tuning.tile_sizes(n_classes, batch_invariant)   # batch_invariant: tiled.invariant_rows
    loss = torch.zeros(n, device=dev)
    lse_s, lse_t, lse_1 = torch.zeros_like(loss), torch.zeros_like(loss), torch.zeros_like(loss)
    row_sum = torch.zeros_like(loss) if beta != 0.0 else None
    valid_all = None if target is None else target != ignore_index

    def blocks(r, v_start=0, v_step=1):
        for v0 in range(v_start * tile_vocab, n_classes, v_step * tile_vocab):
            cols = slice(v0, v0 + tile_vocab)
            yield (v0, cols) + _block_logits_pair(hs, ws, bs, teacher_hidden, teacher_weight, teacher_bias, r, cols,
                                                  student_softcap, teacher_softcap, inv_t, temperature)

    def row_blocks(k, workers):   # passes 1 and 2; share k: token blocks k, k + workers, ... (disjoint rows)
        for r0 in range(k * tile_rows, n, workers * tile_rows):
            r = slice(r0, r0 + tile_rows)
            m = hs[r].shape[0]
            t_r = None if target is None else target[r]
            run_s, run_t = _Lse(m, dev), _Lse(m, dev)
            run_1 = _Lse(m, dev) if hard and temperature != 1.0 else None
            c_tgt = torch.zeros(m, device=dev)
            for v0, _cols, cs, us, ut in blocks(r):
                run_s.add(us)
                run_t.add(ut)
                if run_1 is not None:
                    run_1.add(cs)
                if hard:
                    owned, col = _target_columns(t_r, valid_all[r], v0, cs.shape[1])
                    c_tgt += torch.where(owned, cs.gather(1, col[:, None])[:, 0], 0.0)
            ls0, lt0 = run_s.value(), run_t.value()
            l10 = ls0 if run_1 is None else run_1.value()
            div = torch.zeros(m, device=dev)
            rsum = torch.zeros(m, device=dev)
            for _v0, _cols, _cs, us, ut in blocks(r):
                d_div, d_sum = divergence(us - ls0[:, None], ut - lt0[:, None], beta)
                div += d_div
                if d_sum is not None:
                    rsum += d_sum
            rows = div
            if t_r is not None:
                if hard:
                    rows = rows + hard_label_weight * (l10 - c_tgt)
                in_range = (t_r >= 0) & (t_r < n_classes)
                rows = torch.where(valid_all[r], torch.where(in_range, rows, float("nan")), 0.0)
            loss[r], lse_s[r], lse_t[r], lse_1[r] = rows, ls0, lt0, l10
            if row_sum is not None:
                row_sum[r] = rsum

    launch.run(row_blocks, -(-n // tile_rows), dev)
    if grad_factor is None:
        return loss, None, None, None
    g_h, g_w, g_b = _gradients(hs, ws, bs, target, valid_all, grad_factor, lse_s, lse_t, lse_1, row_sum, blocks,
                               beta, temperature, hard_label_weight, student_softcap, tile_rows, tile_vocab)
    return loss, g_h, g_w, g_b


def _gradients(hs, ws, bs, target, valid_all, grad_factor, lse_s, lse_t, lse_1, row_sum, blocks, beta, temperature,
               hard_label_weight, s_cap, tile_rows, tile_vocab):
    """Pass 3: ``(grad_h, grad_w, grad_b)``, vocabulary blocks shared out among threads."""
    n, n_classes = hs.shape[0], ws.shape[0]
    dev = hs.device
    fp32 = hs.dtype == torch.float32
    hard = hard_label_weight != 0.0 and target is not None
    g_h = torch.zeros(hs.shape, dtype=torch.float32, device=dev)
    g_w = torch.zeros(ws.shape, dtype=torch.float32, device=dev)
    g_b = torch.zeros(n_classes, dtype=torch.float32, device=dev) if bs is not None else None
    factor_all = grad_factor.float()

    def vocab_blocks(k, workers):   # share k: vocabulary blocks k, k + workers, ... of every token block
        acc_h = g_h if k == 0 else torch.zeros_like(g_h)
        for r0 in range(0, n, tile_rows):
            r = slice(r0, r0 + tile_rows)
            h32 = hs[r] if fp32 else hs[r].float()
            valid = None if valid_all is None else valid_all[r]
            for v0, cols, cs, us, ut in blocks(r, k, workers):
                hard_blk = None
                if hard:
                    hard_blk = hard_label_weight * torch.exp(cs - lse_1[r, None])
                    owned, col = _target_columns(target[r], valid, v0, cs.shape[1])
                    hard_blk.scatter_add_(1, col[:, None], torch.where(owned, -hard_label_weight, 0.0)[:, None])
                du = grad_u(us - lse_s[r, None], ut - lse_t[r, None], beta, None if row_sum is None else row_sum[r])
                dz = chain(du, cs, hard_blk, temperature, s_cap) * factor_all[r, None]
                if valid is not None:
                    dz = torch.where(valid[:, None], dz, 0.0)
                w_blk = ws[cols]
                acc_h[r].addmm_(dz, w_blk if fp32 else w_blk.float())
                g_w[cols].addmm_(dz.t(), h32)
                if g_b is not None:
                    g_b[cols] += dz.sum(dim=0)
        return acc_h

    g_h = launch.add_shares(g_h, launch.run(vocab_blocks, -(-n_classes // tile_vocab), dev))
    return (g_h if fp32 else g_h.to(hs.dtype)), g_w, g_b
