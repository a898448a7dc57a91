"""The linear K-class log-probs (``linear_token_log_probs`` with a ``(..., K)`` target) as the loop kind ``kclass``
(``lm_head/kinds.py``: one node for the forward and one for the backward whatever the token count)."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.core.options import LossOptions
from fusedce.backends.protocol import ChunkCE, TiledCE
from fusedce.lm_head import kinds, loop
from fusedce.lm_head.kinds import Args, loss_args, register
from fusedce.lm_head.head import compact_rows, head_spec, make_head, rebuild_head, scatter_rows
from fusedce.rl.kclass_head import entries, linear_forward, linear_grads, log_probs_at


@register("kclass")
class _KClass:
    """K classes per token. Tensors ``hidden, weight, bias, target`` (the backward's then ``lse, lse_lo, entropy,
    x, grad_log_probs, grad_entropy``); ints ``ignore_index, tiled, chunk_size, deterministic`` then
    ``want_entropy`` (backward: ``needs`` x3); words ``backend,logits`` (``head.head_spec``)."""

    @staticmethod
    def _head(a: Args):
        return rebuild_head(a.word(0), bool(a.i[1]), a.i[2], bool(a.i[3]), a.word(1), a.t[0].device)

    @classmethod
    def forward(cls, a: Args) -> list:
        hidden, weight, bias, target = a.t
        lse, lse_lo, entropy, x = linear_forward(cls._head(a), hidden, weight, bias, target, a.opts(), bool(a.i[4]))
        return [lse, lse_lo, lse.new_empty(0) if entropy is None else entropy, x]

    @staticmethod
    def forward_fake(a: Args) -> list:
        hidden, target, n, f32 = a.t[0], a.t[3], a.t[0].shape[0], torch.float32
        x_dtype = f32 if a.i[1] else loop.logits_dtype(hidden.dtype, a.word(1))
        return [hidden.new_empty(n, dtype=f32), hidden.new_empty(n, dtype=f32),
                hidden.new_empty(n if a.i[4] else 0, dtype=f32), hidden.new_empty(target.shape, dtype=x_dtype)]

    @classmethod
    def backward(cls, a: Args) -> list:
        hidden = a.t[0]
        needs = tuple(map(bool, a.i[4:7]))
        grads = linear_grads(cls._head(a), *a.t, a.opts(), needs)
        dtypes = (hidden.dtype, torch.float32, torch.float32)
        return [hidden.new_empty(0, dtype=d) if g is None or not need else g
                for g, need, d in zip(grads, needs, dtypes)]

    @staticmethod
    def backward_fake(a: Args) -> list:
        return loop.grads_fake(a.t[0], a.t[1], a.i[4:7], torch.float32)


def _args(opts: LossOptions, spec: tuple, *flags) -> tuple:
    backend, tiled, chunk_size, deterministic, logits = spec
    return (*loss_args(opts, tiled, chunk_size, deterministic, *flags), f"{backend},{logits}")


class _LinearLogProbsK(torch.autograd.Function):
    """``hidden @ weight.T + bias`` never materialized: a ``head.py`` head (chunked or tiled)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, spec: tuple, opts: LossOptions, want_entropy: bool, needs):
        lse, lse_lo, entropy, x = kinds.forward("kclass", [hidden, weight, bias, target],
                                                *_args(opts, spec, want_entropy))
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
        g_h, g_w, g_b = kinds.backward("kclass", [hidden, weight, bias, target, lse, lse_lo,
                                                  entropy if k is not None else None, x, grad_log_probs, k],
                                       *_args(ctx.opts, ctx.spec, *ctx.needs))
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
