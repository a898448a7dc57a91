"""The LM head with probability ("soft") targets: the chunk loop over the backends' probability-target row
ops and the tiled head over the PyTorch blocked loop, behind one small interface used by
``ce/linear_soft.py`` (the shape of ``head.py``, with the target a (BT, V) tensor and no row ignored).

- ``SoftChunkedHead`` (``method="chunked"``): per chunk of ``rows`` tokens, ``logits_c = h_c @ W.T (+ b)``
  into one reused buffer (``loop.logits_chunk``), then the backend's ``soft_ce_forward`` op on
  ``(logits_c, q[c])`` and, for mean / sum, its ``soft_ce_backward_inplace`` op writing dL/dlogits_c over
  the chunk, then ``loop.backprop_chunk_`` (3 matmuls per token; the same ops ``cross_entropy`` runs
  with a float target: ``backends/pytorch/soft_targets.py``, ``backends/triton/soft_targets.py``).
- ``SoftTiledHead`` (``method="tiled"``): ``backends/pytorch/soft_tiled.py`` (blocks of tokens x a
  vocabulary block, the target read block by block) on every backend; 4 matmuls per token.

``forward(...) -> (loss, lse, lse_lo, a, predicted)`` (fp32 (n,) each, ``a = sum_c w_c q'_c``; loss
without the z-loss; predicted int64 or None without stats); ``grads(...)`` -> the same five (None where
recomputed from ``saved``) plus ``(grad_hidden, grad_weight, grad_bias)``.
"""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.backends.pytorch.custom_ops import soft_tiled_backward, soft_tiled_forward
from fusedce.core.opaque import opaque_op
from fusedce.core.options import LossOptions
from fusedce.core.row_math import grad_lse
from . import loop
from .loop import f32, or_empty, rows_of
from .head import resolve_method

_OP_NAMESPACES = {"torch": "fusedce_torch", "triton": "fusedce"}   # backends/*/soft_targets.py
Opt = Optional[torch.Tensor]
Tensor = torch.Tensor


def soft_ops(impl):
    """``(forward, backward_inplace)``: the backend's probability-target row ops (torch custom ops); ``impl``
    the backend package (its ``NAME``)."""
    ns = getattr(torch.ops, _OP_NAMESPACES[impl.NAME])
    return ns.soft_ce_forward, ns.soft_ce_backward_inplace


class _SoftChunks:
    """The chunk loop itself (eager), ``rows`` tokens a chunk, the backend named ``backend``'s row ops."""

    def __init__(self, backend: str, rows: int, logits: str = "float32"):
        ns = getattr(torch.ops, _OP_NAMESPACES[backend])
        self.forward_op, self.backward_op = ns.soft_ce_forward, ns.soft_ce_backward_inplace
        self.rows, self.logits = rows, logits   # logits: chunked.logits_dtype's choice

    def _chunks(self, hidden, weight, bias):
        n = hidden.shape[0]
        buffer = loop.chunk_buffer(n, self.rows, weight, hidden.dtype, self.logits)
        for s in range(0, n, self.rows):
            c = slice(s, s + self.rows)
            yield c, loop.logits_chunk(hidden[c], weight, bias, buffer, self.logits)

    def forward(self, hidden, weight, bias, q, w, opts: LossOptions, stats: bool):
        n = hidden.shape[0]
        out = [torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(4)]
        predicted = torch.empty(n, dtype=torch.int64, device=hidden.device) if stats else None
        for c, logits in self._chunks(hidden, weight, bias):
            *rows, pred = self.forward_op(logits, q[c], w, *opts.op_args(), stats, False)
            for dst, src in zip(out, rows):
                dst[c] = src
            if stats:
                predicted[c] = pred
        return (*out, predicted)

    def grads(self, hidden, weight, bias, q, w, opts: LossOptions, grad_row, z_grad_row, needs, accum_dtype,
              saved=None, stats: bool = False):
        if saved is not None:
            lse, lse_lo, a = saved
            g_lse = grad_lse(lse, z_grad_row, opts)

            def grad_of_chunk(c, logits):
                self.backward_op(logits, q[c], w, lse[c], lse_lo[c], a[c], grad_row[c],
                                 None if g_lse is None else g_lse[c], *opts.op_args())
                return logits

            grads = loop.backprop_chunks(hidden, weight, bias, self.rows, needs, accum_dtype, grad_of_chunk,
                                         self.logits)
            return (None, lse, lse_lo, a, None, *grads)
        n = hidden.shape[0]
        loss, lse, lse_lo, a = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(4))
        predicted = torch.empty(n, dtype=torch.int64, device=hidden.device) if stats else None
        grad_h, grad_w, grad_b = loop.grad_buffers(hidden, weight, needs, accum_dtype)
        for c, logits in self._chunks(hidden, weight, bias):
            q_c = q[c]
            loss_c, lse_c, lo_c, a_c, pred = self.forward_op(logits, q_c, w, *opts.op_args(), stats, False)
            loss[c], lse[c], lse_lo[c], a[c] = loss_c, lse_c, lo_c, a_c
            if stats:
                predicted[c] = pred
            self.backward_op(logits, q_c, w, lse_c, lo_c, a_c, grad_row[c], grad_lse(lse_c, z_grad_row[c], opts),
                             *opts.op_args())
            loop.backprop_chunk_(logits, hidden[c], weight, c, grad_h, grad_w, grad_b)
            del logits
        return loss, lse, lse_lo, a, predicted, grad_h, grad_w, grad_b


@opaque_op("fusedce_lm::soft_chunked_forward", mutates_args=(), observable=True)
def _forward_op(hidden: Tensor, weight: Tensor, bias: Opt, q: Tensor, w: Opt, ignore_index: int, scalars: list[float],
                backend: str, chunk_size: int, logits: str, stats: bool
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    *rows, predicted = _SoftChunks(backend, rows_of(chunk_size, hidden, weight), logits).forward(
        hidden, weight, bias, q, w, LossOptions.from_op_args(ignore_index, scalars), stats)
    return (*rows, or_empty(predicted, hidden, torch.int64))


@_forward_op.register_fake
def _(hidden, weight, bias, q, w, ignore_index, scalars, backend, chunk_size, logits, stats):
    n = hidden.shape[0]
    return (*(f32(hidden, n) for _ in range(4)), hidden.new_empty(n if stats else 0, dtype=torch.int64))


@opaque_op("fusedce_lm::soft_chunked_grads", mutates_args=(), observable=True)
def _grads_op(hidden: Tensor, weight: Tensor, bias: Opt, q: Tensor, w: Opt, ignore_index: int, scalars: list[float],
              backend: str, chunk_size: int, logits: str, grad_row: Tensor, z_grad_row: Tensor, needs_hidden: bool,
              needs_weight: bool, needs_bias: bool, accum_dtype: torch.dtype, stats: bool, lse: Opt, lse_lo: Opt,
              a: Opt) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    saved = None if lse is None else (lse, lse_lo, a)
    out = _SoftChunks(backend, rows_of(chunk_size, hidden, weight), logits).grads(
        hidden, weight, bias, q, w, LossOptions.from_op_args(ignore_index, scalars), grad_row, z_grad_row,
        (needs_hidden, needs_weight, needs_bias), accum_dtype, saved, stats)
    loss, lse_out, lo_out, a_out, predicted, g_h, g_w, g_b = out
    if saved is not None:   # never return an input (a custom op may not alias one): the entry point has them
        lse_out = lo_out = a_out = None
    return (or_empty(loss, hidden), or_empty(lse_out, hidden), or_empty(lo_out, hidden), or_empty(a_out, hidden),
            or_empty(predicted, hidden, torch.int64), or_empty(g_h, hidden, hidden.dtype),
            or_empty(g_w, hidden, accum_dtype), or_empty(g_b, hidden, accum_dtype))


@_grads_op.register_fake
def _(hidden, weight, bias, q, w, ignore_index, scalars, backend, chunk_size, logits, grad_row, z_grad_row,
      needs_hidden, needs_weight, needs_bias, accum_dtype, stats, lse, lse_lo, a):
    n = hidden.shape[0]
    k = n if lse is None else 0
    return (*(f32(hidden, k) for _ in range(4)), hidden.new_empty(k if stats else 0, dtype=torch.int64),
            hidden.new_empty(hidden.shape if needs_hidden else (0,)),
            weight.new_empty(weight.shape if needs_weight else (0,), dtype=accum_dtype),
            weight.new_empty(weight.shape[0] if needs_bias else 0, dtype=accum_dtype))


class _ProbsRows:
    def rows_forward(self, hidden, weight, bias, q, w, weight_sum, opts: LossOptions, stats: bool):
        """``head.LinearHeadFunction``'s interface: no per-row factor, ``a`` the per-row state."""
        loss, lse, lse_lo, a, predicted = self.forward(hidden, weight, bias, q, w, opts, stats)
        return loss, lse, lse_lo, predicted, None, a

    def rows_grads(self, hidden, weight, bias, q, w, weight_sum, opts: LossOptions, grad_row, z_grad_row, needs,
                   accum_dtype, saved=None, stats: bool = False):
        saved = None if saved is None else (saved[0], saved[1], saved[3])
        loss, lse, lse_lo, a, predicted, *grads = self.grads(hidden, weight, bias, q, w, opts, grad_row, z_grad_row,
                                                             needs, accum_dtype, saved, stats)
        return (loss, lse, lse_lo, predicted, None, a, *grads)


class SoftChunkedHead(_ProbsRows):
    """``method="chunked"``: ``_SoftChunks`` through one op per loop (``fusedce_lm::soft_chunked_forward`` /
    ``soft_chunked_grads``: a tracer sees one node whatever the token count, ``loop.py``'s reason; the
    rows per chunk decided from the real count, ``chunk_size`` None for the rule)."""
    grads_in_forward = True

    def __init__(self, impl, chunk_size: Optional[int], logits: str = "float32"):
        self.backend, self.chunk_size, self.logits = impl.NAME, chunk_size or 0, logits

    def forward(self, hidden, weight, bias, q, w, opts: LossOptions, stats: bool):
        *rows, predicted = _forward_op(hidden, weight, bias, q, w, *opts.op_args(), self.backend, self.chunk_size,
                                       self.logits, stats)
        return (*rows, predicted if stats else None)

    def grads(self, hidden, weight, bias, q, w, opts: LossOptions, grad_row, z_grad_row, needs, accum_dtype,
              saved=None, stats: bool = False):
        """``saved = (lse, lse_lo, a)`` from a forward: only the backward (each chunk recomputed);
        None: the forward too, each chunk's gradient formed right after its loss."""
        lse, lse_lo, a = (None,) * 3 if saved is None else saved
        loss, lse_o, lo_o, a_o, predicted, g_h, g_w, g_b = _grads_op(
            hidden, weight, bias, q, w, *opts.op_args(), self.backend, self.chunk_size, self.logits, grad_row,
            z_grad_row, *needs, accum_dtype, stats, lse, lse_lo, a)
        grads = tuple(g if need else None for g, need in zip((g_h, g_w, g_b), needs))
        if saved is not None:
            return (None, lse, lse_lo, a, None, *grads)
        return (loss, lse_o, lo_o, a_o, predicted if stats else None, *grads)


class SoftTiledHead(_ProbsRows):
    grads_in_forward = False

    def forward(self, hidden, weight, bias, q, w, opts: LossOptions, stats: bool):
        return soft_tiled_forward(hidden, weight, bias, q, w, opts, stats)

    def grads(self, hidden, weight, bias, q, w, opts: LossOptions, grad_row, z_grad_row, needs, accum_dtype,
              saved=None, stats: bool = False):
        if saved is None:
            raise AssertionError("SoftTiledHead.grads recomputes from a forward's saved statistics")
        lse, lse_lo, a = saved
        grads = soft_tiled_backward(hidden, weight, bias, q, w, lse, lse_lo, a, grad_row,
                                               grad_lse(lse, z_grad_row, opts), opts, needs, accum_dtype)
        return (None, lse, lse_lo, a, None, *grads)


def make_soft_head(impl, method: str, n_rows: int, hidden_size: int, vocab_size: int,
                   chunk_size: Optional[int], device_type: str, logits: str = "float32"):
    """The head for ``method`` ("auto" resolved by ``head.resolve_method``)."""
    if resolve_method(method) == "tiled":
        return SoftTiledHead()
    return SoftChunkedHead(impl, chunk_size, logits)   # rows decided inside the loop's op
