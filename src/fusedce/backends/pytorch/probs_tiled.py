"""``method="tiled"`` with probability ("soft") targets, in plain PyTorch: the LM head + the loss of ``probs_launch.py``
on blocks of tokens x vocabulary (``tuning.tile_sizes``: fewer than V logits a block), the target read block by
block alongside the weight; never a tensor of V or more elements besides the weight, its gradient, the bias and the
target itself."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.options import LossOptions
from fusedce.core.row_math import mul_slope_, transform, two_sum
from . import launch, tuning
from .tiled import _vocab_block, vocab_block_backward

_NEG_INF = float("-inf")
Opt = Optional[torch.Tensor]


def _mixed_block(q: torch.Tensor, w: Opt, opts: LossOptions, n_classes: int) -> torch.Tensor:
    """``u`` of a target block ``q`` ((n, Vb) any float dtype; ``w`` its (Vb,) fp32 class weights or None)
    with the smoothing's ``eps / V`` of the whole vocabulary: a new fp32 tensor."""
    eps = opts.label_smoothing
    u = q.float() * (1.0 - eps) + eps / n_classes if eps > 0.0 else q.to(torch.float32, copy=True)
    return u if w is None else u.mul_(w)


def probs_tiled_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: Opt, q: torch.Tensor, w: Opt,
                       opts: LossOptions, stats: bool):
    """``(loss, lse, lse_lo, a, predicted)`` per token of ``hidden`` (n, H) against ``q`` (n, V): fp32 (n,) each (loss
    without the z-loss; ``a`` = A), predicted the first argmax of the raw logits (int64) or None without ``stats``."""
    n, n_classes = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    loss = torch.zeros(n, device=dev)
    lse, lse_lo, a_all = torch.zeros_like(loss), torch.zeros_like(loss), torch.zeros_like(loss)
    predicted = torch.zeros(n, dtype=torch.int64, device=dev) if stats else None
    tile_rows, tile_vocab = tuning.tile_sizes(n_classes)

    def row_blocks(k, workers):   # share k: row blocks k, k + workers, ... (disjoint outputs)
        mine = [slice(r0, r0 + tile_rows) for r0 in range(k * tile_rows, n, workers * tile_rows)]
        def start(rows):   # one row block's running [m, shift, s, d, a, best, best_idx]
            best = [torch.full((rows,), _NEG_INF, device=dev), torch.zeros(rows, dtype=torch.int64, device=dev)]
            return ([torch.full((rows,), _NEG_INF, device=dev)] + [torch.zeros(rows, device=dev) for _ in range(4)]
                    + (best if stats else [None, None]))

        state = [start(hidden[r].shape[0]) for r in mine]
        for v0 in range(0, n_classes, tile_vocab):   # vocabulary outer (``tiled.py``: the same bits)
            cols = slice(v0, v0 + tile_vocab)
            w32, b32 = _vocab_block(weight, bias, cols)
            for r, st in zip(mine, state):
                m, shift, s, d, a, best, best_idx = st
                x = torch.nn.functional.linear(hidden[r].float(), w32, b32)
                z = transform(x, opts)
                u = _mixed_block(q[r][:, cols], None if w is None else w[cols], opts, n_classes)
                m = torch.maximum(m, z.amax(dim=1))
                new_shift = torch.where(m == _NEG_INF, 0.0, m)
                s = torch.exp(shift - new_shift) * s + torch.exp(z - new_shift[:, None]).sum(dim=1)
                d = d + a * (new_shift - shift)       # re-base D on the new shift (A (c_new - c_old))
                d = d + torch.where(u == 0.0, 0.0, u * (new_shift[:, None] - z)).sum(dim=1)
                a = a + u.sum(dim=1)
                shift = new_shift
                if stats:
                    bmax, bidx = x.max(dim=1)          # first index among ties
                    take = bmax > best
                    best_idx = torch.where(take, bidx + v0, best_idx)
                    best = torch.where(take, bmax, best)
                st[:] = [m, shift, s, d, a, best, best_idx]
        for r, (_m, shift, s, d, a, _best, best_idx) in zip(mine, state):
            log_s = torch.log(s)
            hi, lo = two_sum(shift, log_s)
            loss[r] = d + a * log_s
            lse[r], lse_lo[r], a_all[r] = hi, lo, a
            if stats:
                predicted[r] = best_idx

    launch.run(row_blocks, -(-n // tile_rows), dev)
    return loss, lse, lse_lo, a_all, predicted


def probs_tiled_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: Opt, q: torch.Tensor, w: Opt,
                        lse: torch.Tensor, lse_lo: torch.Tensor, a: torch.Tensor, grad_row: torch.Tensor,
                        grad_lse: Opt, opts: LossOptions, needs, accum_dtype: torch.dtype):
    """``(grad_hidden, grad_weight, grad_bias)`` of ``sum_i grad_row[i] loss_i + grad_lse[i] lse_i`` (None
    where ``needs`` says no): grad_hidden in hidden's dtype, the others in ``accum_dtype``."""
    n_classes = weight.shape[0]
    g_all = grad_row.float()
    factor_all = g_all * a if grad_lse is None else g_all * a + grad_lse.float()

    def dz_of(x, r, cols, v0):
        z = transform(x, opts)
        u = _mixed_block(q[r][:, cols], None if w is None else w[cols], opts, n_classes)
        p = torch.sub(z, lse[r, None]).sub_(lse_lo[r, None]).exp_()
        return mul_slope_(p.mul_(factor_all[r, None]).sub_(u.mul_(g_all[r, None])), z, opts)

    return vocab_block_backward(hidden, weight, bias, needs, accum_dtype, tuning.tile_sizes(n_classes), dz_of)
