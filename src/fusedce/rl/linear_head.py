"""Per-token log-probabilities and entropy for RL (``token_log_probs`` / ``linear_token_log_probs``), on any backend's
``ChunkCE`` / ``TiledCE``."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.core.options import LossOptions
from fusedce.lm_head import invariant, loop
from fusedce.lm_head.head import TiledHead, compact_rows, make_head, scatter_rows
from fusedce.backends.protocol import ChunkCE, TiledCE


def _outputs(loss, entropy, target, opts: LossOptions):
    valid = opts.kept(target)
    log_probs = torch.where(valid, -loss, 0.0)
    if entropy is None:
        entropy = log_probs.new_empty(0)
    return log_probs, entropy


def _no_stats(like: torch.Tensor):
    return like.new_empty(0), like.new_empty(0), like.new_empty(0, dtype=torch.bool)


def _upstream(grad_log_probs, grad_entropy, n: int, want_entropy: bool, like: torch.Tensor):
    """(grad_row, grad_entropy) for the backend: -g of the log-probs (zeros when unused)."""
    grad_row = like.new_zeros(()).expand(n) if grad_log_probs is None else -grad_log_probs.float()
    return grad_row, (grad_entropy if want_entropy else None)


class _LogProbs(torch.autograd.Function):
    """Logits given (``token_log_probs``): the backend's ChunkCE on all rows at once."""

    @staticmethod
    def forward(ctx, logits, target, ce, opts: LossOptions, want_entropy: bool, want_stats: bool):
        out = ce.loss(logits, target, None, None, opts, False, want_entropy)
        loss, lse, lse_lo = out[:3]
        entropy = out[4] if want_entropy else None
        stats = ce.token_stats(logits, target, lse, lse_lo, opts) if want_stats else _no_stats(lse)
        log_probs, entropy_out = _outputs(loss, entropy, target, opts)
        ctx.save_for_backward(logits, target, lse, lse_lo, entropy_out)
        ctx.ce, ctx.opts, ctx.want_entropy, ctx.consumed = ce, opts, want_entropy, False
        ctx.mark_non_differentiable(*stats)
        return (log_probs, entropy_out, *stats)

    @staticmethod
    @backward_formula
    def backward(ctx, grad_log_probs, grad_entropy, *_stats):
        check_backward_allowed(ctx, "fusedce.token_log_probs")
        logits, target, lse, lse_lo, entropy = ctx.saved_tensors
        grad_row, k = _upstream(grad_log_probs, grad_entropy, target.shape[0], ctx.want_entropy, lse)
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        ctx.ce.grad_(logits, target, None, None, lse, lse_lo, grad_row, None, ctx.opts, grad_entropy=k,
                     entropy=entropy, out=grad)
        return grad, None, None, None, None, None


class _LinearLogProbs(torch.autograd.Function):
    """``hidden @ weight.T + bias`` never materialized: a ``head.py`` head (chunked or tiled)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, head, opts: LossOptions, want_entropy: bool, want_stats: bool,
                needs):
        if not want_stats:
            loss, lse, lse_lo, _, _, entropy = head.forward(hidden, weight, bias, target, None, None, opts, False,
                                                            want_entropy)
            stats = _no_stats(lse)
        elif isinstance(head, TiledHead):
            rows = head.tiled.forward(hidden, weight, bias, target, None, None, opts, False, want_entropy,
                                      token_stats=True, batch_invariant=head.batch_invariant)
            loss, lse, lse_lo, entropy, stats = rows.loss, rows.lse, rows.lse_lo, rows.entropy, rows.token_stats
        else:
            loss, lse, lse_lo, entropy, stats = loop.loss_with_token_stats(
                head.ce, head.chunk_size, hidden, weight, bias, target, opts, want_entropy, head.logits)
        log_probs, entropy_out = _outputs(loss, entropy, target, opts)
        ctx.save_for_backward(hidden, weight, bias, target, lse, lse_lo, entropy_out)
        ctx.head, ctx.opts, ctx.want_entropy, ctx.needs = head, opts, want_entropy, needs
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(*stats)
        return (log_probs, entropy_out, *stats)

    @staticmethod
    @backward_formula
    def backward(ctx, grad_log_probs, grad_entropy, *_stats):
        check_backward_allowed(ctx, "fusedce.linear_token_log_probs")
        hidden, weight, bias, target, lse, lse_lo, entropy = ctx.saved_tensors
        grad_row, k = _upstream(grad_log_probs, grad_entropy, target.shape[0], ctx.want_entropy, lse)
        saved = (lse, lse_lo, None, entropy if k is not None else None)
        *_, g_h, g_w, g_b = ctx.head.grads(hidden, weight, bias, target, None, None, ctx.opts, grad_row, grad_row,
                                           ctx.needs, torch.float32, saved=saved, grad_entropy=k)
        g_w = None if g_w is None else g_w.to(ctx.dtypes[0])
        g_b = None if g_b is None else g_b.to(ctx.dtypes[1])
        return g_h, g_w, g_b, None, None, None, None, None, None


def token_log_probs(ce: ChunkCE, logits: torch.Tensor, target: torch.Tensor, opts: LossOptions,
                    want_entropy: bool, want_stats: bool = False):
    """Backend entry: ``logits`` (BT, V) last-dim stride 1, ``target`` (BT,) -> ``(log_probs, entropy,
    log_sum_sq_probs, mean_logits, is_top1)`` (BT,) each (entropy empty unless ``want_entropy``, the
    last three (``types.TokenStats``) empty unless ``want_stats``)."""
    return _LogProbs.apply(logits, target, ce, opts, want_entropy, want_stats)


def linear_token_log_probs(ce: ChunkCE, hidden, weight, target, bias, opts: LossOptions, want_entropy: bool,
                           chunk_size: Optional[int], method: str, want_stats: bool = False, *,
                           tiled: Optional[TiledCE] = None, deterministic: bool = False, logits: str = "float32",
                           batch_invariant: bool = False):
    """Backend entry: ``hidden`` (BT, H), ``weight`` (V, H), ``target`` (BT,) -> as ``token_log_probs``
    (the five per-row outputs); ignored rows compacted away; ``deterministic`` as in ``head.make_head``;
    ``batch_invariant``: the kept rows padded to the head's row multiple (``lm_head/invariant.py``)."""
    n = hidden.shape[0]
    hidden, target, index = compact_rows(hidden, target, opts.ignore_index)
    kept = hidden.shape[0]
    chunk_size = invariant.ROWS if batch_invariant else chunk_size
    head = make_head(ce, tiled, method, hidden.shape[0], hidden.shape[1], weight.shape[0], chunk_size,
                     deterministic, hidden.device.type, logits, batch_invariant)
    if batch_invariant:
        hidden, target, _ = invariant.pad_rows(hidden, target, opts.ignore_index, None,
                                               head.invariant_rows(weight.shape[0]))
    needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    log_probs, entropy, *stats = _LinearLogProbs.apply(hidden, weight, bias, target, head, opts, want_entropy,
                                                       want_stats, needs)
    if batch_invariant:   # the padding rows dropped (a no-op slice without padding; no traced size test)
        log_probs, entropy = log_probs[:kept], entropy[:kept] if want_entropy else entropy
        stats = [v[:kept] for v in stats] if want_stats else stats
    return scatter_outputs(log_probs, entropy, stats, index, n, want_entropy, want_stats)


def scatter_outputs(log_probs, entropy, stats, index, n: int, want_entropy: bool, want_stats: bool) -> tuple:
    """The compacted rows' ``(log_probs, entropy, *stats)`` back at their ``n`` rows (0 / False elsewhere)."""
    log_probs = scatter_rows(log_probs, index, n, 0.0)
    if want_entropy:
        entropy = scatter_rows(entropy, index, n, 0.0)
    if want_stats:
        stats = [scatter_rows(v, index, n, fill) for v, fill in zip(stats, (0.0, 0.0, False))]
    return (log_probs, entropy, *stats)
