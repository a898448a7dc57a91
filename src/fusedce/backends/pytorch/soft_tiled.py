"""``method="tiled"`` with probability ("soft") targets, in plain PyTorch: the LM head + the loss of
``soft_launch.py`` on blocks of tokens x vocabulary (``tuning.tile_sizes``: fewer than V logits a block),
the target read block by block alongside the weight; never a tensor of V or more elements besides the
weight, its gradient, the bias and the target itself. Every backend's ``method="tiled"`` with a float
target runs this loop (on the tensors' device; on Triton it is torch ops, not a tiled Triton kernel).

Notation as ``soft_launch.py``: ``u_c = w_c ((1 - eps) q_c + eps / V)``, ``A = sum_c u_c``.

Forward, per token block r, vocabulary block j (columns ``cols``):
    x = h_r @ W_j.T + b_j in fp32 from the operands' values (``tiled._block_logits``); z = transform(x)
    online softmax (Milakov & Gimelshein 2018): m the running max, c = m (0 while m = -inf) its finite
    shift, S = sum exp(z - c); and D = sum_c u_c (c - z_c), re-based with c: D += A_old (c_new - c_old);
    A += sum_j u. At the end lse = c + log S (an exact fp32 pair, TwoSum) and
        loss = sum_c u_c (lse - z_c) = D + A log S
    (each term of D is >= 0 for q >= 0 and the re-basing adds A (c_new - c_old) >= 0 once m is finite:
    no cancellation; a column with u_c = 0 adds exactly 0, also at a -inf logit).
Backward (from the saved lse pair and A; each block recomputed):
    dz = (g A + h) p - g u,  p = exp((z - lse) - lse_lo), then ``row_math.mul_slope_``, kept in fp32 (as
    the chunked method on CPU); grad_h_r += dz @ W_j (fp32), grad_W_j += dz.T @ h_r, grad_b_j += sum_rows dz
    (summed in fp32 per vocabulary block and rounded to ``accum_dtype`` once: ``block_accum.py``).
Both passes loop vocabulary block outer (``tiled.py``'s order: each weight block upcast once per share,
the same bits). FLOPs: 2 BT V H forward, 6 BT V H backward. Memory beyond the inputs and the returned
gradients: a few fp32 blocks (logits, target, exp, gradient) of fewer than V values each per thread, O(BT) row
statistics, and per extra thread of the backward one fp32 ``BT x H`` accumulator of grad_h (plus one
for non-fp32 hidden); with a 16-bit ``accum_dtype`` one fp32 ``vocab x H`` block of grad_W per thread.
Threads: ``block_threads.py`` (the forward shares out row blocks, the backward vocabulary blocks), as
``tiled.py``.
"""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.options import LossOptions
from fusedce.core.row_math import mul_slope_, transform, two_sum
from . import block_threads, tuning
from .block_accum import VocabBlockGrads
from .tiled import _vocab_block

_NEG_INF = float("-inf")
Opt = Optional[torch.Tensor]


def _mixed_block(q: torch.Tensor, w: Opt, opts: LossOptions, n_classes: int) -> torch.Tensor:
    """``u`` of a target block ``q`` ((n, Vb) any float dtype; ``w`` its (Vb,) fp32 class weights or None)
    with the smoothing's ``eps / V`` of the whole vocabulary: a new fp32 tensor."""
    eps = opts.label_smoothing
    u = q.float() * (1.0 - eps) + eps / n_classes if eps > 0.0 else q.to(torch.float32, copy=True)
    return u if w is None else u.mul_(w)


def soft_tiled_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: Opt, q: torch.Tensor, w: Opt,
                       opts: LossOptions, stats: bool):
    """``(loss, lse, lse_lo, a, predicted)`` per token of ``hidden`` (n, H) against ``q`` (n, V): fp32 (n,)
    each (loss without the z-loss; ``a`` = A), predicted the first argmax of the raw logits (int64) or
    None without ``stats``. No gradient."""
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

    block_threads.run(row_blocks, -(-n // tile_rows), dev)
    return loss, lse, lse_lo, a_all, predicted


def soft_tiled_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: Opt, q: torch.Tensor, w: Opt,
                        lse: torch.Tensor, lse_lo: torch.Tensor, a: torch.Tensor, grad_row: torch.Tensor,
                        grad_lse: Opt, opts: LossOptions, needs, accum_dtype: torch.dtype):
    """``(grad_hidden, grad_weight, grad_bias)`` of ``sum_i grad_row[i] loss_i + grad_lse[i] lse_i`` (None
    where ``needs`` says no): grad_hidden in hidden's dtype, the others in ``accum_dtype``."""
    n, n_classes = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    fp32 = hidden.dtype == torch.float32
    grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if needs[0] else None
    grad_w = torch.zeros(weight.shape, dtype=accum_dtype, device=dev) if needs[1] else None
    grad_b = torch.zeros(n_classes, dtype=accum_dtype, device=dev) if needs[2] else None
    g_all = grad_row.float()
    factor_all = g_all * a if grad_lse is None else g_all * a + grad_lse.float()
    tile_rows, tile_vocab = tuning.tile_sizes(n_classes)

    def vocab_blocks(k, workers):   # share k: vocabulary blocks k, k + workers, ... of every row block
        acc_h = grad_h if k == 0 or grad_h is None else torch.zeros_like(grad_h)
        for v0 in range(k * tile_vocab, n_classes, workers * tile_vocab):   # vocabulary outer (``tiled.py``)
            cols = slice(v0, v0 + tile_vocab)
            w32, b32 = _vocab_block(weight, bias, cols)
            block = VocabBlockGrads(grad_w, grad_b, cols)   # rounded to accum_dtype once (block_accum.py)
            for r0 in range(0, n, tile_rows):
                r = slice(r0, r0 + tile_rows)
                h, q_r = hidden[r], q[r]
                h32 = h if fp32 else h.float()
                x = torch.nn.functional.linear(h32, w32, b32)
                z = transform(x, opts)
                u = _mixed_block(q_r[:, cols], None if w is None else w[cols], opts, n_classes)
                p = torch.sub(z, lse[r, None]).sub_(lse_lo[r, None]).exp_()
                dz = mul_slope_(p.mul_(factor_all[r, None]).sub_(u.mul_(g_all[r, None])), z, opts)
                if acc_h is not None:
                    acc_h[r].addmm_(dz, w32)
                block.add(dz, h32)
            block.store()
        return acc_h

    partial_h = block_threads.run(vocab_blocks, -(-n_classes // tile_vocab), dev)
    for part in partial_h[1:]:   # the other shares' grad_h, added in a fixed order (deterministic)
        if part is not None:
            grad_h += part
    if grad_h is not None and not fp32:
        grad_h = grad_h.to(hidden.dtype)
    return grad_h, grad_w, grad_b
