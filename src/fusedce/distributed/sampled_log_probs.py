"""``vocab_parallel_linear_token_log_probs`` with ``top_k`` / ``top_p``, ``return_stats`` or
``logits_dtype="input"``: PyTorch ops per chunk (``sampled_rows.py``), per-row statistics exchanged, never
logits; every rank takes the same rows per chunk."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.core.options import LossOptions
from fusedce.core.row_math import mul_slope_, transform
from fusedce.distributed import sampled_rows as sr
from fusedce.distributed.exchange import sum_over_ranks_
from fusedce.distributed.layout import VocabLayout
from fusedce.lm_head import loop
from fusedce.lm_head.head import compact_rows
from fusedce.rl import truncated_rows as tr
from fusedce.rl.linear_head import scatter_outputs

NAME = "fusedce.distributed.vocab_parallel_linear_token_log_probs"


def _sliced(t: Optional[torch.Tensor], c: slice) -> Optional[torch.Tensor]:
    return None if t is None else t[c]


class _SampledLinearLogProbs(torch.autograd.Function):
    """hidden (n, H), weight and bias slices -> log-probs, entropy (n,) fp32 (differentiable), then the statistics."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, top_k, top_p, layout: VocabLayout, opts: LossOptions, rows: int,
                logits: str, want_entropy: bool, want_stats: bool, needs):
        n, dev = hidden.shape[0], hidden.device
        lp, ent, lse, thr = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(4))
        inside = torch.empty(n, dtype=torch.bool, device=dev)
        stats = [torch.empty(n if want_stats else 0, dtype=d, device=dev)
                 for d in (torch.float32, torch.float32, torch.bool)]
        buffer = loop.chunk_buffer(n, rows, weight, hidden.dtype, logits)
        for s in range(0, n, rows):
            c = slice(s, s + rows)
            q = transform(loop.logits_chunk(hidden[c], weight, bias, buffer, logits).float(), opts)
            k = top_k[c] if isinstance(top_k, torch.Tensor) else top_k
            r = sr.forward(q, target[c], k, _sliced(top_p, c), layout, want_entropy, want_stats)
            valid = opts.kept(target[c])   # ignored rows left in (no compaction under tracing): 0, no gradient
            lp[c], lse[c], thr[c], inside[c] = torch.where(valid, r.log_prob, 0.0), r.lse, r.thr, r.inside & valid
            if want_entropy:
                ent[c] = torch.where(valid, r.entropy, 0.0)
            if want_stats:
                for out, value in zip(stats, r.stats):
                    out[c] = torch.where(valid, value, torch.zeros((), dtype=value.dtype, device=dev))
            del q
        ctx.save_for_backward(hidden, weight, bias, target, thr, lse, inside, ent)
        ctx.layout, ctx.opts, ctx.rows, ctx.logits, ctx.needs = layout, opts, rows, logits, needs
        ctx.want_entropy = want_entropy
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(*stats)
        return (lp, ent if want_entropy else lp.new_empty(0), *stats)

    @staticmethod
    @backward_formula
    def backward(ctx, g_lp, g_ent, *_stats):
        check_backward_allowed(ctx, NAME)
        hidden, weight, bias, target, thr, lse, inside, ent = ctx.saved_tensors
        opts, layout = ctx.opts, ctx.layout
        valid = opts.kept(target)
        g_lp = None if g_lp is None else torch.where(valid, g_lp.float(), 0.0)
        g_ent = torch.where(valid, g_ent.float(), 0.0) if ctx.want_entropy and g_ent is not None else None

        def grad_of_chunk(c, x):
            q = transform(x.float(), opts)
            g = sr.grad_q(q, target[c], thr[c], lse[c], inside[c], ent[c] if g_ent is not None else None,
                          _sliced(g_lp, c), _sliced(g_ent, c), layout)
            return mul_slope_(g, q, opts)

        g_h, g_w, g_b = loop.backprop_chunks(hidden, weight, bias, ctx.rows, ctx.needs, torch.float32,
                                             grad_of_chunk, ctx.logits)
        if ctx.needs[0] and hidden.shape[0] > 0:
            sum_over_ranks_(g_h, layout.group)   # each rank holds sum over its own classes of g_c W_c
        g_w = None if g_w is None else g_w.to(ctx.dtypes[0])
        g_b = None if g_b is None else g_b.to(ctx.dtypes[1])
        return (g_h, g_w, g_b) + (None,) * 10


def _rows(chunk_size: Optional[int], hidden: torch.Tensor, layout: VocabLayout) -> int:
    """Rows per chunk, the same on every rank (the loop's collectives pair up chunk by chunk)."""
    if chunk_size:
        return int(chunk_size)
    world = dist.get_world_size(layout.group)
    mean_slice = -(-layout.n_classes // max(world, 1))
    return loop.chunk_rows(hidden.shape[0], hidden.shape[1], mean_slice, hidden.device.type)


def linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
                     top_k, top_p, layout: VocabLayout, opts: LossOptions, chunk_size: Optional[int], logits: str,
                     want_entropy: bool, want_stats: bool) -> tuple:
    """``hidden`` (n, H), ``target`` (n,) global ids -> ``(log_probs, entropy, *stats)`` (n,) each (empty when
    not asked); ignored rows compacted first (one host sync)."""
    n, dev = hidden.shape[0], hidden.device
    if isinstance(top_k, torch.Tensor):   # a number stays one (one gathered k-th largest per row)
        top_k = tr.per_row(top_k, n, torch.int64, 0, dev)
    top_p = None if top_p is None else tr.per_row(top_p, n, torch.float32, 1.0, dev)
    hidden, target, index = compact_rows(hidden, target, opts.ignore_index)
    if index is not None:
        top_k = top_k.index_select(0, index) if isinstance(top_k, torch.Tensor) else top_k
        top_p = None if top_p is None else top_p.index_select(0, index)
    needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    log_probs, entropy, *stats = _SampledLinearLogProbs.apply(
        hidden, weight, bias, target, top_k, top_p, layout, opts, max(1, _rows(chunk_size, hidden, layout)), logits,
        want_entropy, want_stats, needs)
    return scatter_outputs(log_probs, entropy, stats, index, n, want_entropy, want_stats)
