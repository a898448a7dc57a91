"""The linear K-class log-probs (``linear_token_log_probs`` with a ``(..., K)`` target) through two ops, so that a
tracer sees one node for the forward and one for the backward whatever the token count (the reason
and the mechanism are ``lm_head/loop.py``'s: the chunk loops, the gathers and the sparse gradient loops all step
over the rows)."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.core.opaque import opaque_op
from fusedce.core.options import LossOptions
from fusedce.backends.protocol import ChunkCE, TiledCE
from fusedce.lm_head import loop
from fusedce.lm_head.head import compact_rows, head_spec, make_head, rebuild_head, scatter_rows
from fusedce.rl.kclass_head import entries, linear_forward, linear_grads, log_probs_at

Opt = Optional[torch.Tensor]
Tensor = torch.Tensor


@opaque_op("fusedce_rl::k_forward", mutates_args=(), observable=True)
def _forward_op(hidden: Tensor, weight: Tensor, bias: Opt, target: Tensor, ignore_index: int, scalars: list[float],
                backend: str, tiled: bool, chunk_size: int, deterministic: bool, logits: str, want_entropy: bool
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    head = rebuild_head(backend, tiled, chunk_size, deterministic, logits, hidden.device)
    lse, lse_lo, entropy, x = linear_forward(head, hidden, weight, bias, target,
                                             LossOptions.from_op_args(ignore_index, scalars), want_entropy)
    return lse, lse_lo, lse.new_empty(0) if entropy is None else entropy, x


@_forward_op.register_fake
def _(hidden, weight, bias, target, ignore_index, scalars, backend, tiled, chunk_size, deterministic, logits,
      want_entropy):
    n = hidden.shape[0]
    f32 = torch.float32
    x_dtype = f32 if tiled else loop.logits_dtype(hidden.dtype, logits)
    return (hidden.new_empty(n, dtype=f32), hidden.new_empty(n, dtype=f32),
            hidden.new_empty(n if want_entropy else 0, dtype=f32), hidden.new_empty(target.shape, dtype=x_dtype))


@opaque_op("fusedce_rl::k_backward", mutates_args=(), observable=True)
def _backward_op(hidden: Tensor, weight: Tensor, bias: Opt, target: Tensor, lse: Tensor, lse_lo: Tensor,
                 entropy: Opt, x: Tensor, grad_log_probs: Opt, grad_entropy: Opt, ignore_index: int,
                 scalars: list[float], backend: str, tiled: bool, chunk_size: int, deterministic: bool, logits: str,
                 needs_hidden: bool, needs_weight: bool, needs_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    head = rebuild_head(backend, tiled, chunk_size, deterministic, logits, hidden.device)
    needs = (needs_hidden, needs_weight, needs_bias)
    grads = linear_grads(head, hidden, weight, bias, target, lse, lse_lo, entropy, x, grad_log_probs, grad_entropy,
                         LossOptions.from_op_args(ignore_index, scalars), needs)
    dtypes = (hidden.dtype, torch.float32, torch.float32)
    return tuple(hidden.new_empty(0, dtype=d) if g is None or not need else g
                 for g, need, d in zip(grads, needs, dtypes))


@_backward_op.register_fake
def _(hidden, weight, bias, target, lse, lse_lo, entropy, x, grad_log_probs, grad_entropy, ignore_index, scalars,
      backend, tiled, chunk_size, deterministic, logits, needs_hidden, needs_weight, needs_bias):
    f32 = torch.float32
    return (hidden.new_empty(hidden.shape if needs_hidden else (0,)),
            weight.new_empty(weight.shape if needs_weight else (0,), dtype=f32),
            weight.new_empty(weight.shape[0] if needs_bias else 0, dtype=f32))


class _LinearLogProbsK(torch.autograd.Function):
    """``hidden @ weight.T + bias`` never materialized: a ``head.py`` head (chunked or tiled)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, spec: tuple, opts: LossOptions, want_entropy: bool, needs):
        lse, lse_lo, entropy, x = _forward_op(hidden, weight, bias, target, *opts.op_args(), *spec, want_entropy)
        log_probs = _log_probs(x, target, weight.shape[0], lse, lse_lo, opts)
        ctx.save_for_backward(hidden, weight, bias, target, lse, lse_lo, entropy, x)
        ctx.spec, ctx.opts, ctx.want_entropy, ctx.needs = spec, opts, want_entropy, needs
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return log_probs, entropy

    @staticmethod
    @backward_formula
    def backward(ctx, grad_log_probs, grad_entropy):
        check_backward_allowed(ctx, "fusedce.linear_token_log_probs")
        hidden, weight, bias, target, lse, lse_lo, entropy, x = ctx.saved_tensors
        k = grad_entropy if ctx.want_entropy else None
        g_h, g_w, g_b = _backward_op(hidden, weight, bias, target, lse, lse_lo, entropy if k is not None else None,
                                     x, grad_log_probs, k, *ctx.opts.op_args(), *ctx.spec, *ctx.needs)
        g_h = g_h if ctx.needs[0] else None
        g_w = g_w.to(ctx.dtypes[0]) if ctx.needs[1] else None
        g_b = g_b.to(ctx.dtypes[1]) if ctx.needs[2] else None
        return g_h, g_w, g_b, None, None, None, None, None


def _log_probs(x, target, n_classes: int, lse, lse_lo, opts: LossOptions):
    return log_probs_at(x, target, entries(target, opts, n_classes), lse, lse_lo, opts)


def linear_token_log_probs_kclass(ce: ChunkCE, hidden, weight, target, bias, opts: LossOptions,
                                 want_entropy: bool, chunk_size: Optional[int], method: str, *,
                                 tiled: Optional[TiledCE] = None, deterministic: bool = False, logits: str = "float32",
                                 compact: bool = True):
    """Backend entry: ``hidden`` (BT, H), ``weight`` (V, H), ``target`` (BT, K) -> as
    ``kclass_head.token_log_probs_kclass``; rows whose K entries are all ignored are compacted away (one host
    sync), unless ``compact`` is False (a caller that compacted its rows already: the top-k distillation)."""
    n, K = target.shape
    index = None
    if compact:
        rep = entries(target, opts, weight.shape[0]).rep
        hidden, _, index = compact_rows(hidden, rep, opts.ignore_index)
    if index is not None:
        target = target.index_select(0, index)
    head = make_head(ce, tiled, method, hidden.shape[0], hidden.shape[1], weight.shape[0], chunk_size,
                     deterministic, hidden.device.type, logits)
    needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    log_probs, entropy = _LinearLogProbsK.apply(hidden, weight, bias, target, head_spec(head), opts, want_entropy,
                                                needs)
    if index is not None:
        log_probs = log_probs.new_zeros(n, K).index_copy(0, index, log_probs)
        if want_entropy:
            entropy = scatter_rows(entropy, index, n, 0.0)
    return log_probs, entropy
