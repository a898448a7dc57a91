"""The autograd Functions of the RL log-prob ops with ``top_k`` / ``top_p`` (``rl/log_probs.py`` routes there when
either is on): ``token_log_probs`` over row chunks of the logits, ``linear_token_log_probs`` over the chunked
LM-head loop (``lm_head/loop.py``: one chunk of logits at a time, recomputed in the backward), the row math in
``truncated_rows.py`` (PyTorch ops on each chunk's fp32 ``q``: the same on every backend)."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.core.options import LossOptions
from fusedce.core.row_math import mul_slope_, transform
from fusedce.lm_head import loop
from fusedce.lm_head.loop import chunk_rows
from fusedce.lm_head.head import compact_rows, scatter_rows
from fusedce.rl import truncated_rows as tr

CHUNK_ELEMENTS = 1 << 23   # rows of the logits form per chunk: this many elements of q (32 MiB in fp32)


def _rows_per_chunk(v: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(v, 1))


def _q(x: torch.Tensor, opts: LossOptions) -> torch.Tensor:
    return transform(x.float(), opts)


def _chunk_forward(q, target, top_k, top_p, opts: LossOptions, want_entropy: bool):
    valid = target != opts.ignore_index
    safe = torch.where(valid, target, 0)
    thr = tr.threshold(q, top_k, top_p)
    log_prob, entropy, lse = tr.forward(q, safe, thr, want_entropy)
    log_prob = torch.where(valid, log_prob, 0.0)
    entropy = torch.where(valid, entropy, 0.0) if want_entropy else None
    return log_prob, entropy, thr.squeeze(1), lse


def _chunk_grad(q, target, thr, lse, entropy, g_lp, g_ent, opts: LossOptions):
    valid = target != opts.ignore_index
    safe = torch.where(valid, target, 0)
    g_lp = None if g_lp is None else torch.where(valid, g_lp.float(), 0.0)
    g_ent = None if g_ent is None else torch.where(valid, g_ent.float(), 0.0)
    grad = tr.grad_q(q, safe, thr[:, None], lse, g_lp, g_ent, entropy)
    return mul_slope_(grad, q, opts)


def _outputs(ctx, log_prob, entropy, want_entropy: bool):
    """The Function's two outputs (the entropy empty unless asked, as ``rl/linear_head.py``)."""
    ctx.want_entropy = want_entropy
    return log_prob, (entropy if want_entropy else log_prob.new_empty(0))


class _TruncatedLogProbs(torch.autograd.Function):
    """Logits given: row chunks of ``_rows_per_chunk(V)``."""

    @staticmethod
    def forward(ctx, logits, target, top_k, top_p, opts: LossOptions, want_entropy: bool):
        n = logits.shape[0]
        rows = _rows_per_chunk(logits.shape[1])
        lp, ent, thr, lse = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(4))
        for s in range(0, n, rows):
            c = slice(s, s + rows)
            out = _chunk_forward(_q(logits[c], opts), target[c], top_k[c], top_p[c], opts, want_entropy)
            lp[c], thr[c], lse[c] = out[0], out[2], out[3]
            if want_entropy:
                ent[c] = out[1]
        ctx.save_for_backward(logits, target, thr, lse, ent)
        ctx.opts = opts
        return _outputs(ctx, lp, ent, want_entropy)

    @staticmethod
    @backward_formula
    def backward(ctx, g_lp, g_ent):
        check_backward_allowed(ctx, "fusedce.token_log_probs")
        logits, target, thr, lse, ent = ctx.saved_tensors
        g_ent = g_ent if ctx.want_entropy else None
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        rows = _rows_per_chunk(logits.shape[1])
        for s in range(0, logits.shape[0], rows):
            c = slice(s, s + rows)
            grad[c] = _chunk_grad(_q(logits[c], ctx.opts), target[c], thr[c], lse[c], ent[c],
                                  None if g_lp is None else g_lp[c], None if g_ent is None else g_ent[c], ctx.opts)
        return grad, None, None, None, None, None


class _TruncatedLinearLogProbs(torch.autograd.Function):
    """``hidden @ weight.T + bias`` one chunk of ``rows`` tokens at a time (``lm_head/loop.py``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, top_k, top_p, opts: LossOptions, want_entropy: bool,
                rows: int, logits: str, needs):
        n = hidden.shape[0]
        lp, ent, thr, lse = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(4))
        buffer = loop.chunk_buffer(n, rows, weight, hidden.dtype, logits)
        for s in range(0, n, rows):
            c = slice(s, s + rows)
            x = loop.logits_chunk(hidden[c], weight, bias, buffer, logits)
            out = _chunk_forward(_q(x, opts), target[c], top_k[c], top_p[c], opts, want_entropy)
            lp[c], thr[c], lse[c] = out[0], out[2], out[3]
            if want_entropy:
                ent[c] = out[1]
        ctx.save_for_backward(hidden, weight, bias, target, thr, lse, ent)
        ctx.opts, ctx.rows, ctx.logits, ctx.needs = opts, rows, logits, needs
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return _outputs(ctx, lp, ent, want_entropy)

    @staticmethod
    @backward_formula
    def backward(ctx, g_lp, g_ent):
        check_backward_allowed(ctx, "fusedce.linear_token_log_probs")
        hidden, weight, bias, target, thr, lse, ent = ctx.saved_tensors
        g_ent = g_ent if ctx.want_entropy else None

        def grad_of_chunk(c, x):
            return _chunk_grad(_q(x, ctx.opts), target[c], thr[c], lse[c], ent[c],
                               None if g_lp is None else g_lp[c], None if g_ent is None else g_ent[c], ctx.opts)

        g_h, g_w, g_b = loop.backprop_chunks(hidden, weight, bias, ctx.rows, ctx.needs, torch.float32,
                                                grad_of_chunk, ctx.logits)
        g_w = None if g_w is None else g_w.to(ctx.dtypes[0])
        g_b = None if g_b is None else g_b.to(ctx.dtypes[1])
        return g_h, g_w, g_b, None, None, None, None, None, None, None, None


def _params(top_k, top_p, n: int, device):
    return tr.per_row(top_k, n, torch.int64, 0, device), tr.per_row(top_p, n, torch.float32, 1.0, device)


def token_log_probs(logits: torch.Tensor, target: torch.Tensor, top_k, top_p, opts: LossOptions,
                    want_entropy: bool):
    """``logits`` (BT, V) last-dim stride 1, ``target`` (BT,), checked ``top_k`` / ``top_p`` (None, a number
    or a tensor of BT elements) -> ``(log_probs, entropy)`` (BT,) fp32 (entropy empty unless asked)."""
    top_k, top_p = _params(top_k, top_p, target.shape[0], logits.device)
    return _TruncatedLogProbs.apply(logits, target, top_k, top_p, opts, want_entropy)


def linear_token_log_probs(hidden, weight, target, bias, top_k, top_p, opts: LossOptions, want_entropy: bool,
                           chunk_size: Optional[int], logits: str = "float32"):
    """``hidden`` (BT, H), ``weight`` (V, H), ``target`` (BT,) -> as ``token_log_probs``; ignored rows
    compacted away first (``compact_rows``: the linear ops' one host sync)."""
    n = hidden.shape[0]
    top_k, top_p = _params(top_k, top_p, n, hidden.device)
    hidden, target, index = compact_rows(hidden, target, opts.ignore_index)
    if index is not None:
        top_k, top_p = top_k.index_select(0, index), top_p.index_select(0, index)
    rows = chunk_size or chunk_rows(hidden.shape[0], hidden.shape[1], weight.shape[0], hidden.device.type)
    needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    log_probs, entropy = _TruncatedLinearLogProbs.apply(hidden, weight, bias, target, top_k, top_p, opts,
                                                        want_entropy, max(1, rows), logits, needs)
    log_probs = scatter_rows(log_probs, index, n, 0.0)
    if want_entropy:
        entropy = scatter_rows(entropy, index, n, 0.0)
    return log_probs, entropy
