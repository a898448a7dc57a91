"""Autograd of the distillation losses, on any backend's row op (``distill_rows``) and tiled op (``tiled_distill``);
the signatures are in ``backends/pytorch/distill.py`` / ``distill_tiled.py``."""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.lm_head import invariant
from fusedce.lm_head.head import HEADROOM_EXP, compact_rows, resolve_method, scaled_, scatter_rows
from .chunk_op import chunked_distill


def reduce_rows(loss: torch.Tensor, reduction: str, scale: torch.Tensor) -> torch.Tensor:
    """"none": the (N,) rows; "sum": their sum; "mean": the sum times ``scale`` (= 1 / denominator, 0 for 0)."""
    if reduction == "none":
        return loss
    total = loss.sum()
    return total if reduction == "sum" else total * scale


def _upstream(grad_out: torch.Tensor, reduction: str, scale: torch.Tensor, n: int) -> torch.Tensor:
    """The (N,) fp32 per-row upstream gradient of the row losses."""
    if reduction == "none":
        return grad_out.float().reshape(n).contiguous()
    g = grad_out.float() if reduction == "sum" else scale * grad_out.float()
    return g.expand(n).contiguous()


def distill_headroom(scale: torch.Tensor, temperature: float, hard_label_weight: float) -> torch.Tensor:
    """``P`` (0-dim fp32 power of two, no host sync) for forward-made gradients, from the bound
    ``|scale| (1 / T + |hard_label_weight|)`` of a row's ``|dL/dz|``."""
    m = scale.abs() * (1.0 / temperature + abs(hard_label_weight))
    _, e = torch.frexp(m)
    return torch.ldexp(torch.ones_like(m), HEADROOM_EXP - e).to(m.dtype)


class _Distill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, target, rows_op, kw: dict, reduction: str, scale):
        loss, _ = rows_op(student, teacher, target, None, **kw)
        ctx.save_for_backward(student, teacher, target, scale)
        ctx.rows_op, ctx.kw, ctx.reduction = rows_op, kw, reduction
        return reduce_rows(loss, reduction, scale)

    @staticmethod
    @backward_formula
    def backward(ctx, grad_out):
        check_backward_allowed(ctx, "fusedce.distillation_loss")
        student, teacher, target, scale = ctx.saved_tensors
        factor = _upstream(grad_out, ctx.reduction, scale, student.shape[0])
        _, grad = ctx.rows_op(student, teacher, target, factor, **ctx.kw)
        return grad, None, None, None, None, None, None


def distillation(rows_op, student, teacher, target, kw: dict, reduction: str, scale: torch.Tensor):
    """(N, V) logits of both models, (N,) target or None -> the reduced fp32 loss (or (N,) rows)."""
    teacher = teacher.detach()
    if torch.is_grad_enabled() and student.requires_grad:
        return _Distill.apply(student, teacher, target, rows_op, kw, reduction, scale)
    with torch.no_grad():
        loss, _ = rows_op(student, teacher, target, None, **kw)
    return reduce_rows(loss, reduction, scale)


class ChunkedDistill:
    """``method="chunked"``: both models' logits a chunk of rows at a time (``chunk_op.py``: one op, so that
    a tracer does not specialize on the token count); ``chunk_size`` None for the rule."""

    def __init__(self, backend: str, chunk_size: Optional[int]):
        self.backend, self.chunk_size = backend, chunk_size

    def run(self, hs, ws, bs, ht, wt, bt, target, grad_factor, kw: dict, needs):
        """``(loss, grad_h, grad_w, grad_b)``: (N,) fp32 rows; the gradients (None unless ``needs`` and
        ``grad_factor``) of ``sum_r grad_factor[r] loss[r]``, grad_h in hidden's dtype, the others fp32."""
        with torch.no_grad():
            return chunked_distill(self.backend, self.chunk_size, hs, ws, bs, ht, wt, bt, target, grad_factor, kw,
                                   needs)


class TiledDistill:
    """``method="tiled"``: the backend's ``tiled_distill`` (no logits tensor of either model)."""

    def __init__(self, tiled_op, deterministic: bool, batch_invariant: bool = False):
        self.tiled_op, self.deterministic, self.batch_invariant = tiled_op, deterministic, batch_invariant

    def run(self, hs, ws, bs, ht, wt, bt, target, grad_factor, kw: dict, needs):
        with torch.no_grad():
            loss, g_h, g_w, g_b = self.tiled_op(hs, ws, bs, ht, wt, bt, target, grad_factor, **kw,
                                                deterministic=self.deterministic,
                                                batch_invariant=self.batch_invariant)
        if grad_factor is None:
            return loss, None, None, None
        return (loss, g_h if needs[0] else None, None if g_w is None or not needs[1] else g_w.float(),
                None if g_b is None or not needs[2] else g_b.float())


def _padded(factor: torch.Tensor, n: int) -> torch.Tensor:
    """The (n_real,) per-row factor followed by zeros up to ``n`` rows (batch_invariant's padding rows get
    no gradient: their logits' gradient is exactly 0, so they add nothing to the weight and bias gradients)."""
    if not torch.compiler.is_compiling() and factor.shape[0] == n:
        return factor
    return torch.nn.functional.pad(factor, (0, n - factor.shape[0]))   # no traced size test (invariant.pad_rows)


def headroom_holds(kw: dict, dtype: torch.dtype) -> bool:
    """Whether ``distill_headroom``'s bound holds, so mean / sum gradients may be made in the forward."""
    return not (kw["beta"] == 1.0 and dtype == torch.float16)


class _LinearDistill(torch.autograd.Function):
    """The first ``n_real`` rows are the loss's; any rows after them are ``batch_invariant``'s padding."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, target, head, kw: dict, reduction: str, scale, needs, n_real: int):
        ctx.grads = None
        n = hs.shape[0]
        if reduction == "none" or not headroom_holds(kw, hs.dtype):
            loss = head.run(hs, ws, bs, ht, wt, bt, target, None, kw, needs)[0]
        else:   # gradients made here, times P; the backward applies g / P
            p = distill_headroom(scale, kw["temperature"], kw["hard_label_weight"])
            ctx.unscale = 1.0 / p   # exact: a power of two
            factor = _padded((scale * p).expand(n_real).contiguous(), n)
            loss, *ctx.grads = head.run(hs, ws, bs, ht, wt, bt, target, factor, kw, needs)
        ctx.save_for_backward(hs, ws, bs, ht, wt, bt, target, scale)
        ctx.head, ctx.kw, ctx.reduction, ctx.needs, ctx.n_real = head, kw, reduction, needs, n_real
        ctx.dtypes = (ws.dtype, None if bs is None else bs.dtype)
        return reduce_rows(loss[:n_real], reduction, scale)

    @staticmethod
    @backward_formula
    def backward(ctx, grad_out):
        check_backward_allowed(ctx, "fusedce.linear_distillation_loss")
        if ctx.grads is not None:   # first backward of mean / sum: scale what the forward made
            (g_h, g_w, g_b), ctx.grads = ctx.grads, None
            g = grad_out.float() * ctx.unscale
            g_h, g_w, g_b = (scaled_(t, g) for t in (g_h, g_w, g_b))
        else:                       # "none" or a second backward: recompute with the exact upstream
            hs, ws, bs, ht, wt, bt, target, scale = ctx.saved_tensors
            factor = _padded(_upstream(grad_out, ctx.reduction, scale, ctx.n_real), hs.shape[0])
            _, g_h, g_w, g_b = ctx.head.run(hs, ws, bs, ht, wt, bt, target, factor, ctx.kw, ctx.needs)
        g_w = None if g_w is None else g_w.to(ctx.dtypes[0])
        g_b = None if g_b is None else g_b.to(ctx.dtypes[1])
        return (g_h, g_w, g_b) + (None,) * (_N_INPUTS - 3)


_N_INPUTS = len(inspect.signature(_LinearDistill.forward).parameters) - 1


def make_distill_head(backend: str, tiled_op, method: str, chunk_size: Optional[int], deterministic: bool,
                      batch_invariant: bool = False):
    """``ChunkedDistill`` / ``TiledDistill`` for ``method`` (``"auto"`` as ``linear_cross_entropy``'s rule)."""
    if resolve_method(method) == "tiled":
        return TiledDistill(tiled_op, deterministic, batch_invariant)
    return ChunkedDistill(backend, chunk_size)


def _pad_rows(hs, ht, target, ignore_index: int, rows: int):
    """``batch_invariant``: the rows padded to a multiple of ``rows`` with zero hidden rows and ``ignore_index``
    targets, which get a zero upstream factor."""
    pad = -hs.shape[0] % rows
    if not torch.compiler.is_compiling() and pad == 0:
        return hs, ht, target
    F = torch.nn.functional   # F.pad, not torch.cat: no traced size test (``invariant.pad_rows``)
    hs, ht = F.pad(hs, (0, 0, 0, pad)), F.pad(ht, (0, 0, 0, pad))
    if target is not None:
        target = F.pad(target, (0, pad), value=ignore_index)
    return hs, ht, target


def linear_distillation(backend: str, tiled_op, hs, ws, bs, ht, wt, bt, target, kw: dict, reduction: str,
                        scale: torch.Tensor, method: str, chunk_size: Optional[int], deterministic: bool,
                        batch_invariant: bool = False):
    """(N, H) / (N, Ht) hidden states, (V, H) / (V, Ht) heads, (N,) target or None -> the reduced loss; ``backend`` the
    backend's name (its ``distill_rows`` runs each chunk), ``tiled_op`` its ``tiled_distill``."""
    n = hs.shape[0]
    index = None
    if target is not None:
        hs, target, index = compact_rows(hs, target, kw["ignore_index"])
        if index is not None:
            ht = ht.index_select(0, index)
    n_real = hs.shape[0]
    if batch_invariant:
        tiled = resolve_method(method) == "tiled"
        rows = tiled_op.invariant_rows(ws.shape[0]) if tiled else invariant.ROWS
        hs, ht, target = _pad_rows(hs, ht.detach(), target, kw["ignore_index"], rows)
        method, chunk_size = ("tiled", None) if tiled else ("chunked", invariant.ROWS)
    ht, wt = ht.detach(), wt.detach()
    bt = None if bt is None else bt.detach()
    head = make_distill_head(backend, tiled_op, method, chunk_size, deterministic, batch_invariant)
    needs = (hs.requires_grad, ws.requires_grad, bs is not None and bs.requires_grad)
    if torch.is_grad_enabled() and any(needs):
        out = _LinearDistill.apply(hs, ws, bs, ht, wt, bt, target, head, kw, reduction, scale, needs, n_real)
    else:
        with torch.no_grad():
            loss = head.run(hs, ws, bs, ht, wt, bt, target, None, kw, needs)[0]
            out = reduce_rows(loss[:n_real], reduction, scale)
    if reduction == "none":
        out = scatter_rows(out, index, n, 0.0)
    return out
