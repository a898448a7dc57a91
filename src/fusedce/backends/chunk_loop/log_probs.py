"""Per-token log-probabilities and entropy for RL (``token_log_probs`` / ``linear_token_log_probs``),
on any backend's ``ChunkCE`` / ``TiledCE``.

The caller's options (``validation.log_prob_options``) fold temperature and softcap into the loss
options, so that the backend's cross-entropy of a row is ``-log_probs`` and its entropy that of
``softmax(q)``. Gradients: the upstream gradient of ``log_probs`` reaches the backend as ``grad_row =
-g`` and that of the entropy as ``grad_entropy`` (formula in ``protocols.py``); both may be given at
once (policy-gradient loss plus an entropy bonus). Ignored rows: 0 in both outputs, zero gradient,
and in the linear form no matmul FLOPs (compacted as ``linear_cross_entropy`` does).
"""
from __future__ import annotations

from typing import Optional

import torch

from ...autograd_checks import check_backward_allowed
from ...types import LossOptions
from .api import compact_rows, make_head, scatter_rows
from .protocols import ChunkCE, TiledCE


def _outputs(loss, entropy, target, opts: LossOptions):
    valid = opts.kept(target)
    log_probs = torch.where(valid, -loss, 0.0)
    if entropy is None:
        entropy = log_probs.new_empty(0)
    return log_probs, entropy


def _upstream(grad_log_probs, grad_entropy, n: int, want_entropy: bool, like: torch.Tensor):
    """(grad_row, grad_entropy) for the backend: -g of the log-probs (zeros when unused)."""
    grad_row = like.new_zeros(()).expand(n) if grad_log_probs is None else -grad_log_probs.float()
    return grad_row, (grad_entropy if want_entropy else None)


class _LogProbs(torch.autograd.Function):
    """Logits given (``token_log_probs``): the backend's ChunkCE on all rows at once."""

    @staticmethod
    def forward(ctx, logits, target, ce, opts: LossOptions, want_entropy: bool):
        out = ce.loss(logits, target, None, None, opts, False, want_entropy)
        loss, lse, lse_lo = out[:3]
        entropy = out[4] if want_entropy else None
        log_probs, entropy_out = _outputs(loss, entropy, target, opts)
        ctx.save_for_backward(logits, target, lse, lse_lo, entropy_out)
        ctx.ce, ctx.opts, ctx.want_entropy, ctx.consumed = ce, opts, want_entropy, False
        return log_probs, entropy_out

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        check_backward_allowed(ctx, "fusedce.token_log_probs")
        logits, target, lse, lse_lo, entropy = ctx.saved_tensors
        grad_row, k = _upstream(grad_log_probs, grad_entropy, target.shape[0], ctx.want_entropy, lse)
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        ctx.ce.grad_(logits, target, None, None, lse, lse_lo, grad_row, None, ctx.opts, grad_entropy=k,
                     entropy=entropy, out=grad)
        return grad, None, None, None, None


class _LinearLogProbs(torch.autograd.Function):
    """``hidden @ weight.T + bias`` never materialized: a ``heads.py`` head (chunked or tiled)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, head, opts: LossOptions, want_entropy: bool, needs):
        loss, lse, lse_lo, _, _, entropy = head.forward(hidden, weight, bias, target, None, None, opts, False,
                                                        want_entropy)
        log_probs, entropy_out = _outputs(loss, entropy, target, opts)
        ctx.save_for_backward(hidden, weight, bias, target, lse, lse_lo, entropy_out)
        ctx.head, ctx.opts, ctx.want_entropy, ctx.needs = head, opts, want_entropy, needs
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return log_probs, entropy_out

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        check_backward_allowed(ctx, "fusedce.linear_token_log_probs")
        hidden, weight, bias, target, lse, lse_lo, entropy = ctx.saved_tensors
        grad_row, k = _upstream(grad_log_probs, grad_entropy, target.shape[0], ctx.want_entropy, lse)
        saved = (lse, lse_lo, None, entropy if k is not None else None)
        *_, g_h, g_w, g_b = ctx.head.grads(hidden, weight, bias, target, None, None, ctx.opts, grad_row, grad_row,
                                           ctx.needs, torch.float32, saved=saved, grad_entropy=k)
        g_w = None if g_w is None else g_w.to(ctx.dtypes[0])
        g_b = None if g_b is None else g_b.to(ctx.dtypes[1])
        return g_h, g_w, g_b, None, None, None, None, None


def token_log_probs(ce: ChunkCE, logits: torch.Tensor, target: torch.Tensor, opts: LossOptions,
                    want_entropy: bool):
    """Backend entry: ``logits`` (BT, V) last-dim stride 1, ``target`` (BT,) -> ``(log_probs, entropy)``
    (BT,) fp32 each (entropy an empty tensor unless ``want_entropy``)."""
    return _LogProbs.apply(logits, target, ce, opts, want_entropy)


def linear_token_log_probs(ce: ChunkCE, hidden, weight, target, bias, opts: LossOptions, want_entropy: bool,
                           chunk_size: Optional[int], method: str, *, tiled: Optional[TiledCE] = None):
    """Backend entry: ``hidden`` (BT, H), ``weight`` (V, H), ``target`` (BT,) -> ``(log_probs,
    entropy)`` (BT,) fp32 each (entropy empty unless ``want_entropy``); ignored rows compacted away."""
    n = hidden.shape[0]
    hidden, target, index = compact_rows(hidden, target, opts.ignore_index)
    head = make_head(ce, tiled, method, hidden.shape[0], hidden.shape[1], weight.shape[0], chunk_size,
                     hidden.device.type)
    needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    log_probs, entropy = _LinearLogProbs.apply(hidden, weight, bias, target, head, opts, want_entropy, needs)
    log_probs = scatter_rows(log_probs, index, n, 0.0)
    return log_probs, (scatter_rows(entropy, index, n, 0.0) if want_entropy else entropy)
