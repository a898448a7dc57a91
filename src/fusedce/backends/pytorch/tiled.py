"""``method="tiled"`` in plain PyTorch: the Triton tiled algorithm on blocks of tokens x vocabulary, never a
tensor of V elements besides the head's (its semantics and memory tested on CPU)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from fusedce.core.bf16_products import exact_bf16_gemms
from fusedce.core.options import LossOptions
from ..protocol import TiledRows
from fusedce.core.row_math import row_loss, rows_grad, transform, two_sum
from . import launch, tuning
from .block_accum import VocabBlockGrads

_NEG_INF = float("-inf")


def _block_logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cols: slice):
    """fp32 ``h @ weight[cols].T + bias[cols]``: exact products of the operands' values summed in fp32."""
    return torch.nn.functional.linear(h.float(), *_vocab_block(weight, bias, cols))


def _vocab_block(weight: torch.Tensor, bias: Optional[torch.Tensor], cols: slice) -> tuple:
    """``(W_j, b_j)`` in fp32 (views where already fp32), made once per vocabulary block."""
    return weight[cols].float(), None if bias is None else bias[cols].float()


class _Running:
    """Online row statistics of one token block (fp32 (n,) each, ``T`` only for the entropy)."""

    def __init__(self, n: int, device, smoothing: bool, entropy: bool, stats: bool, token_stats: bool = False):
        self.m = torch.full((n,), _NEG_INF, device=device)
        self.s = torch.zeros(n, device=device)
        self.t = torch.zeros(n, device=device) if entropy else None
        self.zsum = torch.zeros(n, device=device) if smoothing else None
        self.z_t = torch.zeros(n, device=device)
        self.best = torch.full((n,), _NEG_INF, device=device) if stats else None
        self.best_idx = torch.zeros(n, dtype=torch.int64, device=device) if stats else None
        # token_stats: q = sum exp(2 (z - m)), sum_c z_c, and the first argmax of z (``row_math.token_stats``)
        self.q = torch.zeros(n, device=device) if token_stats else None
        self.zsum_all = torch.zeros(n, device=device) if token_stats else None
        self.zbest = torch.full((n,), _NEG_INF, device=device) if token_stats else None
        self.zbest_idx = torch.zeros(n, dtype=torch.int64, device=device) if token_stats else None

    def add(self, x: torch.Tensor, z: torch.Tensor, col_start: int, owned: torch.Tensor, col: torch.Tensor,
            w: Optional[torch.Tensor]) -> None:
        """Merge the block ``z`` ((n, Vb) fp32; raw logits ``x``) of columns from ``col_start``."""
        m_new = torch.maximum(self.m, z.amax(dim=1))
        shift = torch.where(m_new == _NEG_INF, 0.0, m_new)   # all -inf so far: shift by 0, never NaN
        alpha = torch.exp(self.m - shift)                     # 0 when self.m = -inf
        e = torch.exp(z - shift[:, None])
        if self.t is not None:
            # T = sum exp(z - m)(z - m): rescaled by alpha, and each old term gains (m_old - m_new)
            d = torch.where(self.m == _NEG_INF, 0.0, self.m - shift)
            zs = torch.where(z == _NEG_INF, 0.0, (z - shift[:, None]) * e)
            self.t = alpha * (self.t + d * self.s) + zs.sum(dim=1)
        self.s = alpha * self.s + e.sum(dim=1)
        if self.q is not None:   # sum exp(2 (z - m)) re-based like s, by alpha**2
            self.q = alpha * alpha * self.q + (e * e).sum(dim=1)
            self.zsum_all += z.sum(dim=1)
            zmax, zidx = z.max(dim=1)                         # first index among ties
            take = zmax > self.zbest
            self.zbest_idx = torch.where(take, zidx + col_start, self.zbest_idx)
            self.zbest = torch.where(take, zmax, self.zbest)
        self.m = m_new
        self.z_t += torch.where(owned, z.gather(1, col[:, None])[:, 0], 0.0)
        if self.zsum is not None:
            self.zsum += z.sum(dim=1) if w is None else z @ w
        if self.best is not None:
            bmax, bidx = x.max(dim=1)                         # first index among ties
            take = bmax > self.best
            self.best_idx = torch.where(take, bidx + col_start, self.best_idx)
            self.best = torch.where(take, bmax, self.best)


def _target_columns(target: torch.Tensor, valid: torch.Tensor, start: int, width: int):
    owned = valid & (target >= start) & (target < start + width)
    return owned, torch.where(owned, target - start, 0).long()


def invariant_rows(n_classes: int) -> int:
    """``TiledCE.invariant_rows``: ``tuning.tile_sizes(V, True)``'s rows (from V alone, a multiple of 64)."""
    return tuning.tile_sizes(n_classes, True)[0]


class TorchTiledCE:
    """``TiledCE`` in plain PyTorch (through ``custom_ops.py``: ``TORCH_TILED``)."""

    @staticmethod
    def forward(hidden, weight, bias, target, w, weight_sum, opts: LossOptions, stats: bool,
                entropy: bool = False, token_stats: bool = False, batch_invariant: bool = False) -> TiledRows:
        n, n_classes = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        loss = torch.zeros(n, device=dev)
        lse, lse_lo, z_t = torch.zeros_like(loss), torch.zeros_like(loss), torch.zeros_like(loss)
        ent = torch.zeros_like(loss) if entropy else None
        predicted = torch.full((n,), -1, dtype=torch.int64, device=dev)
        if token_stats:
            tstats = (torch.zeros_like(loss), torch.zeros_like(loss), torch.zeros(n, dtype=torch.bool, device=dev))
        valid_all = opts.kept(target)
        smoothing = opts.label_smoothing > 0.0
        tile_rows, tile_vocab = tuning.tile_sizes(n_classes, batch_invariant)

        def row_blocks(k, workers):   # share k: row blocks k, k + workers, ... (disjoint outputs)
            mine = [slice(r0, r0 + tile_rows) for r0 in range(k * tile_rows, n, workers * tile_rows)]
            runs = [_Running(hidden[r].shape[0], dev, smoothing, entropy, stats, token_stats) for r in mine]
            w_ts = [None if w is None else torch.zeros(hidden[r].shape[0], device=dev) for r in mine]
            for v0 in range(0, n_classes, tile_vocab):   # vocabulary outer: each weight block upcast once
                cols = slice(v0, v0 + tile_vocab)
                w32, b32 = _vocab_block(weight, bias, cols)
                for r, run, w_t in zip(mine, runs, w_ts):   # each row still meets the blocks in order
                    t, valid = target[r], valid_all[r]
                    x = torch.nn.functional.linear(hidden[r].float(), w32, b32)
                    owned, col = _target_columns(t, valid, v0, x.shape[1])
                    run.add(x, transform(x, opts), v0, owned, col, None if w is None else w[cols])
                    if w_t is not None:
                        w_t += torch.where(owned, w[cols][col], 0.0)
            for r, run, w_t in zip(mine, runs, w_ts):
                t, valid = target[r], valid_all[r]
                shift = torch.where(run.m == _NEG_INF, 0.0, run.m)
                hi, lo = two_sum(shift, torch.log(run.s))
                row = row_loss(hi, lo, run.z_t, w_t, run.zsum, n_classes if w is None else weight_sum, n_classes,
                               opts)
                in_range = (t >= 0) & (t < n_classes)
                loss[r] = torch.where(valid, torch.where(in_range, row, float("nan")), 0.0)
                lse[r], lse_lo[r] = torch.where(valid, hi, 0.0), torch.where(valid, lo, 0.0)
                z_t[r] = torch.where(valid, run.z_t, 0.0)
                if entropy:
                    ent[r] = torch.where(valid, torch.log(run.s) - run.t / run.s, 0.0)
                if stats:
                    predicted[r] = torch.where(valid, run.best_idx, -1)
                if token_stats:   # log sum p**2 = log Q - 2 log S (both shifted by the same m)
                    tstats[0][r] = torch.where(valid, torch.log(run.q) - 2.0 * torch.log(run.s), 0.0)
                    tstats[1][r] = torch.where(valid, run.zsum_all / n_classes, 0.0)
                    tstats[2][r] = valid & (run.zbest_idx == t)

        # The forward's block-logit GEMMs of bf16 values run on a CPU's bf16 units (``core/bf16_products.py``,
        # exact); the backward's GEMMs take fp32 dz and keep the ieee mode.
        products = contextlib.nullcontext() if smoothing and w is not None else exact_bf16_gemms(hidden, weight)
        with products:
            launch.run(row_blocks, -(-n // tile_rows), dev)
        return TiledRows(loss, lse, lse_lo, predicted, z_t, ent, tstats if token_stats else None)

    @staticmethod
    def backward(hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, opts: LossOptions,
                 needs, accum_dtype, grad_entropy=None, entropy=None, deterministic=False, batch_invariant=False):
        # deterministic: nothing to select, this loop has no atomics (a fixed order of torch ops)
        n_classes = weight.shape[0]
        valid_all = opts.kept(target)
        safe_all = torch.where(valid_all & (target >= 0) & (target < n_classes), target, 0).long()
        w_t_all = None if w is None else w[safe_all]

        def dz_of(x, r, cols, v0):
            return rows_grad(x, target[r], None if w is None else w[cols], weight_sum, lse[r], lse_lo[r], grad_row[r],
                             None if grad_lse is None else grad_lse[r], opts, out=x, n_classes=n_classes,
                             col_start=v0, target_weight=None if w_t_all is None else w_t_all[r],
                             grad_entropy=None if grad_entropy is None else grad_entropy[r],
                             entropy=None if entropy is None else entropy[r])

        return vocab_block_backward(hidden, weight, bias, needs, accum_dtype,
                                    tuning.tile_sizes(n_classes, batch_invariant), dz_of)


def vocab_block_backward(hidden, weight, bias, needs, accum_dtype, tiles, dz_of):
    """``(grad_hidden, grad_weight, grad_bias)`` (None where ``needs`` says no) through the head, for the logits'
    gradient ``dz_of(x, rows, cols, v0)`` of each block of fp32 logits ``x``: vocabulary blocks outer (shared
    over threads, their partial hidden gradients added in a fixed order), row tiles inner; ``grad_hidden`` in
    ``hidden``'s dtype, the others in ``accum_dtype`` (rounded once per block: ``block_accum.py``)."""
    n, n_classes = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    fp32 = hidden.dtype == torch.float32
    grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if needs[0] else None
    grad_w = torch.zeros(weight.shape, dtype=accum_dtype, device=dev) if needs[1] else None
    grad_b = torch.zeros(n_classes, dtype=accum_dtype, device=dev) if needs[2] else None
    tile_rows, tile_vocab = tiles

    def vocab_blocks(k, workers):   # share k: vocabulary blocks k, k + workers, ... of every row block
        acc_h = grad_h if k == 0 or grad_h is None else torch.zeros_like(grad_h)
        for v0 in range(k * tile_vocab, n_classes, workers * tile_vocab):   # vocabulary outer, as forward
            cols = slice(v0, v0 + tile_vocab)
            w32, b32 = _vocab_block(weight, bias, cols)
            block = VocabBlockGrads(grad_w, grad_b, cols)
            for r0 in range(0, n, tile_rows):   # grad_h[r] still gains its blocks in order, grad_W[cols] its rows
                r = slice(r0, r0 + tile_rows)
                h32 = hidden[r] if fp32 else hidden[r].float()
                dz = dz_of(torch.nn.functional.linear(h32, w32, b32), r, cols, v0)
                if acc_h is not None:
                    acc_h[r].addmm_(dz, w32)
                block.add(dz, h32)
            block.store()
        return acc_h

    grad_h = launch.add_shares(grad_h, launch.run(vocab_blocks, -(-n_classes // tile_vocab), dev))
    if grad_h is not None and not fp32:
        grad_h = grad_h.to(hidden.dtype)
    return grad_h, grad_w, grad_b
