"""Vocab-parallel log-probabilities of K given classes per token: ``vocab_parallel_token_log_probs`` /
``vocab_parallel_linear_token_log_probs`` with a ``target`` of shape ``(..., K)`` of GLOBAL class ids, as the
single-process K-class op (``rl/kclass_head.py``) on the vocabulary concatenated over the ranks."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.core.options import LossOptions
from fusedce.distributed import chunk_ops
from fusedce.distributed.exchange import Partials, exchange
from fusedce.distributed.layout import VocabLayout
from fusedce.distributed.kclass_rows import exchange_target_logits, gather_local, grad_of_slice, local_entries
from fusedce.distributed.shard_rows import Columns, shard_forward
from fusedce.rl.kclass_head import Entries, entries, log_probs_of, upstream_k


def _statistics(n: int, device, want_entropy: bool):
    cols = Columns(False, False, want_entropy)
    return cols, Partials.allocate(n, cols, False, device)


def _finish_forward(p: Partials, cols: Columns, x, target, e: Entries, loc: Entries, layout, opts):
    out = exchange(p, e.rep, None, layout, opts, cols)
    entropy = out.lse.new_empty(0) if out.entropy is None else out.entropy
    lse, lse_lo = out.lse, out.lse_lo
    z = exchange_target_logits(x, loc, layout, opts)
    return log_probs_of(z, target, e, lse, lse_lo, opts), entropy, lse, lse_lo


class VocabParallelLogProbsK(torch.autograd.Function):
    """(n, V_r) logits slice, (n, K) global classes -> (log_probs (n, K), entropy (n,) or empty) fp32."""

    @staticmethod
    def forward(ctx, logits, target, layout: VocabLayout, opts: LossOptions, impl, want_entropy: bool):
        e = entries(target, opts, layout.n_classes)
        loc = local_entries(e, layout)
        cols, p = _statistics(logits.shape[0], logits.device, want_entropy)
        p.key, p.zmax, p.sums[:] = shard_forward(impl, logits, e.rep, None, layout, opts, cols)
        log_probs, entropy, lse, lse_lo = _finish_forward(p, cols, gather_local(logits, loc), target, e, loc,
                                                          layout, opts)
        ctx.save_for_backward(logits, target, lse, lse_lo, entropy)
        ctx.layout, ctx.opts, ctx.impl, ctx.want_entropy = layout, opts, impl, want_entropy
        return log_probs, entropy

    @staticmethod
    @backward_formula
    def backward(ctx, grad_log_probs, grad_entropy):
        check_backward_allowed(ctx, "fusedce.distributed.vocab_parallel_token_log_probs")
        logits, target, lse, lse_lo, entropy = ctx.saved_tensors
        e = entries(target, ctx.opts, ctx.layout.n_classes)
        g, G = upstream_k(grad_log_probs, e)
        k = grad_entropy if ctx.want_entropy else None
        grad = grad_of_slice(ctx.impl, logits, e, local_entries(e, ctx.layout), g, G, lse, lse_lo, k, entropy,
                              ctx.layout, ctx.opts)
        return grad, None, None, None, None, None


class VocabParallelLinearLogProbsK(torch.autograd.Function):
    """hidden (n, H), weight slice (V_r, H), bias slice (V_r,), (n, K) global classes -> as
    ``VocabParallelLogProbsK``; the slice's logits one chunk of ``rows`` tokens at a time (None: the rule)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, layout: VocabLayout, opts: LossOptions, rows: Optional[int], impl,
                want_entropy: bool):
        n = hidden.shape[0]
        e = entries(target, opts, layout.n_classes)
        loc = local_entries(e, layout)
        cols, p = _statistics(n, hidden.device, want_entropy)
        key, zmax, sums, x = chunk_ops.forward("kclass", hidden, weight, bias, [target], [], layout, opts, impl, rows,
                                               want_entropy)   # the chunk loop, one op (chunk_ops.py)
        p.set_(key, zmax, sums)
        log_probs, entropy, lse, lse_lo = _finish_forward(p, cols, x, target, e, loc, layout, opts)
        ctx.save_for_backward(hidden, weight, bias, target, lse, lse_lo, entropy)
        ctx.layout, ctx.opts, ctx.rows, ctx.impl, ctx.want_entropy = layout, opts, rows, impl, want_entropy
        return log_probs, entropy

    @staticmethod
    @backward_formula
    def backward(ctx, grad_log_probs, grad_entropy):
        check_backward_allowed(ctx, "fusedce.distributed.vocab_parallel_linear_token_log_probs")
        hidden, weight, bias, target, lse, lse_lo, entropy = ctx.saved_tensors
        layout, opts = ctx.layout, ctx.opts
        g, G = upstream_k(grad_log_probs, entries(target, opts, layout.n_classes))
        k = grad_entropy if ctx.want_entropy else None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h, grad_w, grad_b = chunk_ops.backward(
            "kclass", hidden, weight, bias, [target, g, G, lse, lse_lo, k, None if k is None else entropy], [], layout,
            opts, ctx.impl, ctx.rows, (need_h, need_w, need_b), torch.float32)
        if need_h and hidden.shape[0] > 0:
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=layout.group)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return (grad_h, grad_w, grad_b) + (None,) * 6
