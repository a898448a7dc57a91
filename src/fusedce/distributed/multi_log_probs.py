"""Vocab-parallel log-probabilities of K given classes per token: ``vocab_parallel_token_log_probs`` /
``vocab_parallel_linear_token_log_probs`` with a ``target`` of shape ``(..., K)`` of GLOBAL class ids, as
the single-process K-class op (``rl/multi_head.py``) on the vocabulary concatenated over the ranks.

Forward. A row's lse pair and entropy do not depend on the class asked, so the one-class exchange runs
once per row with the representative target ``rep`` (the row's first non-ignored entry; ``ignore_index``
when all K are ignored, which makes the row an ignored one): ``shard_forward`` + ``exchange.py``'s two
collectives. Then each rank gathers the transformed logits ``z_k`` of the entries its slice holds (0
for the others) and one more ``all_reduce(SUM)`` of ``(n, K)`` fp32 gives every rank every ``z_k`` (one
rank owns each class, so the sum is exact): ``log p_k = (z_k - lse) - lse_lo``. Only row statistics and
the K target logits travel, never a logits row or the target's slice.

Backward (no collective for the logits form; the linear form all-reduces ``grad_hidden`` as the
one-class op). With ``g_k`` the upstream of ``log p_k`` (0 on ignored entries), ``G = sum_k g_k`` and
``k`` the entropy's upstream, the slice's gradient is the single-process one on its columns:

    dL/dz_c = sum_{k: t_k = c} g_k - G p_c - k p_c (log p_c + entropy)

The backend's ``slice_grad`` with ``grad_row = 0`` and ``grad_lse = -G`` writes all of it but the first
term; then the columns of the K entries THIS slice holds are rewritten from the whole formula in fp32,
rounded once (``fix_local_columns_``, as ``multi_head._fix_columns_``: duplicates sum their ``g`` with
identical bits, so the scatter is deterministic). Extra work O(BT K^2) per rank, no V term.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.core.options import LossOptions
from fusedce.core.row_math import transform
from fusedce.distributed.exchange import Partials, exchange
from fusedce.distributed.layout import VocabLayout
from fusedce.distributed.shard_rows import Columns, shard_forward, shard_grad
from fusedce.lm_head.chunked import backprop_chunks, chunk_buffer, logits_chunk
from fusedce.rl.multi_head import Entries, column_grads, entries, log_probs_of, scatter_columns_, upstream_k


def local_entries(e: Entries, layout: VocabLayout) -> Entries:
    """The entries of ``e`` that this rank's slice holds: ``valid`` (n, K), ``safe`` their LOCAL column (0
    elsewhere, never out of bounds), ``first`` the first local entry of each row, ``any`` whether a row
    has one (``rep`` is the global one, unused here)."""
    local = e.valid & (e.safe >= layout.start) & (e.safe < layout.end)
    col = torch.where(local, e.safe - layout.start, 0)
    first = local.to(torch.uint8).argmax(dim=1, keepdim=True)
    return Entries(local, col, e.rep, first, local.any(dim=1))


def rows_of(e: Entries, c: slice) -> Entries:
    return Entries(*(t[c] for t in e))


def gather_local(logits: torch.Tensor, loc: Entries) -> torch.Tensor:
    """The logits (n, V_r) at the local entries' columns, (n, K) in fp32 (0 elsewhere; an empty slice gives
    zeros)."""
    if logits.shape[1] == 0:
        return torch.zeros(loc.safe.shape, dtype=torch.float32, device=logits.device)
    return logits.gather(1, loc.safe).float()


def exchange_target_logits(x: torch.Tensor, loc: Entries, layout: VocabLayout, opts: LossOptions) -> torch.Tensor:
    """Every entry's transformed logit ``z_k`` (n, K) fp32 on every rank: this slice's (0 where it holds
    none), summed over the ranks (``all_reduce(SUM)`` of 4 n K bytes; none with n == 0)."""
    z = torch.where(loc.valid, transform(x, opts), 0.0)
    if z.numel() > 0:
        dist.all_reduce(z, op=dist.ReduceOp.SUM, group=layout.group)
    return z


def fix_local_columns_(grad: torch.Tensor, x: torch.Tensor, e: Entries, loc: Entries, g, G, lse, lse_lo,
                       k: Optional[torch.Tensor], entropy, opts: LossOptions) -> None:
    """Overwrite the local entries' columns of ``grad`` ((n, V_r), any float dtype) with the module
    docstring's whole formula in fp32, rounded once; ``x`` (n, K) fp32 the logits there (before the
    kernel). Rows without a local entry are written back unchanged."""
    if grad.shape[1] == 0 or loc.safe.shape[1] == 0:
        return
    dz = column_grads(x, loc, e.any, g, G, lse, lse_lo, k, entropy, opts)
    scatter_columns_(grad, dz, loc, keep_unwritten=True)


def _statistics(n: int, device, want_entropy: bool):
    cols = Columns(False, False, want_entropy)
    return cols, Partials.allocate(n, cols, False, device)


def _finish_forward(p: Partials, cols: Columns, x, target, e: Entries, loc: Entries, layout, opts):
    out = exchange(p, e.rep, None, layout, opts, cols)
    entropy = out.lse.new_empty(0) if out.entropy is None else out.entropy
    lse, lse_lo = out.lse, out.lse_lo
    z = exchange_target_logits(x, loc, layout, opts)
    return log_probs_of(z, target, e, lse, lse_lo, opts), entropy, lse, lse_lo


def _grad_of_slice(impl, logits, e: Entries, loc: Entries, g, G, lse, lse_lo, k, entropy, layout, opts):
    """The gradient (n, V_r) of one block of rows of this slice's logits (``logits`` may be overwritten)."""
    x = gather_local(logits, loc)   # read before the kernel may overwrite the block
    zero = G.new_zeros(()).expand(G.shape[0])
    grad = shard_grad(impl, logits, e.rep, None, None, None, lse, lse_lo, zero, -G, layout, opts,
                      grad_entropy=k, entropy=entropy if k is not None else None)
    fix_local_columns_(grad, x, e, loc, g, G, lse, lse_lo, k, entropy, opts)
    return grad


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
    def backward(ctx, grad_log_probs, grad_entropy):
        check_backward_allowed(ctx, "fusedce.distributed.vocab_parallel_token_log_probs")
        logits, target, lse, lse_lo, entropy = ctx.saved_tensors
        e = entries(target, ctx.opts, ctx.layout.n_classes)
        g, G = upstream_k(grad_log_probs, e)
        k = grad_entropy if ctx.want_entropy else None
        grad = _grad_of_slice(ctx.impl, logits, e, local_entries(e, ctx.layout), g, G, lse, lse_lo, k, entropy,
                              ctx.layout, ctx.opts)
        return grad, None, None, None, None, None


class VocabParallelLinearLogProbsK(torch.autograd.Function):
    """hidden (n, H), weight slice (V_r, H), bias slice (V_r,), (n, K) global classes -> as
    ``VocabParallelLogProbsK``; the slice's logits one chunk of ``rows`` tokens at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, layout: VocabLayout, opts: LossOptions, rows: int, impl,
                want_entropy: bool):
        n = hidden.shape[0]
        e = entries(target, opts, layout.n_classes)
        loc = local_entries(e, layout)
        cols, p = _statistics(n, hidden.device, want_entropy)
        x = torch.zeros(loc.safe.shape, dtype=torch.float32, device=hidden.device)
        buffer = chunk_buffer(n, rows, weight, hidden.dtype)
        for start in range(0, n, rows):
            c = slice(start, start + rows)
            logits = logits_chunk(hidden[c], weight, bias, buffer)
            p.key[c], p.zmax[c], p.sums[c] = shard_forward(impl, logits, e.rep[c], None, layout, opts, cols)
            x[c] = gather_local(logits, rows_of(loc, c))
        log_probs, entropy, lse, lse_lo = _finish_forward(p, cols, x, target, e, loc, layout, opts)
        ctx.save_for_backward(hidden, weight, bias, target, lse, lse_lo, entropy)
        ctx.layout, ctx.opts, ctx.rows, ctx.impl, ctx.want_entropy = layout, opts, rows, impl, want_entropy
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        check_backward_allowed(ctx, "fusedce.distributed.vocab_parallel_linear_token_log_probs")
        hidden, weight, bias, target, lse, lse_lo, entropy = ctx.saved_tensors
        layout, opts = ctx.layout, ctx.opts
        e = entries(target, opts, layout.n_classes)
        loc = local_entries(e, layout)
        g, G = upstream_k(grad_log_probs, e)
        k = grad_entropy if ctx.want_entropy else None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]

        def slice_grad(c, logits):
            return _grad_of_slice(ctx.impl, logits, rows_of(e, c), rows_of(loc, c), g[c], G[c], lse[c], lse_lo[c],
                                  None if k is None else k[c], entropy[c] if k is not None else entropy, layout, opts)

        grad_h, grad_w, grad_b = backprop_chunks(hidden, weight, bias, ctx.rows, (need_h, need_w, need_b),
                                                 torch.float32, slice_grad)
        if need_h and hidden.shape[0] > 0:
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=layout.group)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return (grad_h, grad_w, grad_b) + (None,) * 6
