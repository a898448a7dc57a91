"""The LM head with probability targets (``ce/linear_probs.py``): ``ProbsChunkedHead`` (the kind ``probs``, the
backend's probability-target row ops per chunk; 3 matmuls per token) and ``ProbsTiledHead``
(``backends/pytorch/probs_tiled.py`` on every backend; 4). ``forward -> (loss, lse, lse_lo, a, predicted)``
(``a = sum_c w_c q'_c``), ``grads`` -> the same five plus the three gradients. Design: ``docs/lm_head.md``."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.backends.pytorch.custom_ops import probs_tiled_backward, probs_tiled_forward
from fusedce.core.options import LossOptions
from fusedce.core.row_math import grad_lse
from . import kinds, loop
from .kinds import Args, loss_args, register
from .loop import f32, grads_fake, or_empty, rows_of
from .head import resolve_method

_OP_NAMESPACES = {"torch": "fusedce_torch", "triton": "fusedce"}   # backends/*/probs_targets.py


def probs_ops(impl):
    """``(forward, backward_inplace)``: the backend's probability-target row ops (torch custom ops); ``impl``
    the backend package (its ``NAME``)."""
    ns = getattr(torch.ops, _OP_NAMESPACES[impl.NAME])
    return ns.probs_ce_forward, ns.probs_ce_backward_inplace


@register("probs")
class _Probs:
    """Probability targets: per chunk the backend's ``probs_ce_forward`` / ``probs_ce_backward_inplace`` ops on
    ``(logits_c, q[c])``. Tensors ``hidden, weight, bias, q, w`` (the backward's then ``grad_row, z_grad_row,
    lse, lse_lo, a``: ``lse`` None to run the forward too); ints ``ignore_index, chunk_size, stats`` (the
    backward's then ``needs`` x3); words ``backend,logits``; the backward's dtype the accumulation's. Outputs
    ``loss, lse, lse_lo, a, predicted`` (then the three gradients; (0,) where not made)."""

    @staticmethod
    def _setup(a: Args):
        ns = getattr(torch.ops, _OP_NAMESPACES[a.word(0)])
        rows = rows_of(a.i[1], a.t[0], a.t[1])
        return ns.probs_ce_forward, ns.probs_ce_backward_inplace, rows, a.word(1), a.opts(), bool(a.i[2])

    @staticmethod
    def _rows(hidden, k: int, stats: bool) -> list:
        return [*(torch.empty(k, dtype=torch.float32, device=hidden.device) for _ in range(4)),
                torch.empty(k if stats else 0, dtype=torch.int64, device=hidden.device)]

    @classmethod
    def forward(cls, a: Args) -> list:
        hidden, weight, bias, q, w = a.t
        forward_op, _, rows, kind, opts, stats = cls._setup(a)
        n = hidden.shape[0]
        out = cls._rows(hidden, n, stats)
        buffer = loop.chunk_buffer(n, rows, weight, hidden.dtype, kind)
        for s in range(0, n, rows):
            c = slice(s, s + rows)
            for dst, src in zip(out, forward_op(loop.logits_chunk(hidden[c], weight, bias, buffer, kind), q[c], w,
                                                *opts.op_args(), stats, False)):
                if dst.numel():
                    dst[c] = src
        return out

    @staticmethod
    def forward_fake(a: Args) -> list:
        hidden, n = a.t[0], a.t[0].shape[0]
        return [*(f32(hidden, n) for _ in range(4)), hidden.new_empty(n if a.i[2] else 0, dtype=torch.int64)]

    @classmethod
    def backward(cls, a: Args) -> list:
        hidden, weight, bias, q, w, grad_row, z_grad_row, lse, lse_lo, a_s = a.t
        forward_op, backward_op, rows, kind, opts, stats = cls._setup(a)
        forward = lse is None
        out = cls._rows(hidden, hidden.shape[0] if forward else 0, stats)
        if forward:
            lse, lse_lo, a_s = out[1:4]
        g_lse = None if forward else grad_lse(lse, z_grad_row, opts)

        def grad_of_chunk(c, logits):
            if forward:
                for dst, src in zip(out, forward_op(logits, q[c], w, *opts.op_args(), stats, False)):
                    if dst.numel():
                        dst[c] = src
            g = grad_lse(lse[c], z_grad_row[c], opts) if forward else None if g_lse is None else g_lse[c]
            backward_op(logits, q[c], w, lse[c], lse_lo[c], a_s[c], grad_row[c], g, *opts.op_args())
            return logits

        grads = loop.backprop_chunks(hidden, weight, bias, rows, tuple(map(bool, a.i[3:6])), a.dtype, grad_of_chunk,
                                     kind)
        return [*out, *(or_empty(g, hidden, d) for g, d in zip(grads, (hidden.dtype, a.dtype, a.dtype)))]

    @staticmethod
    def backward_fake(a: Args) -> list:
        hidden, weight = a.t[0], a.t[1]
        k = hidden.shape[0] if a.t[7] is None else 0
        return [*(f32(hidden, k) for _ in range(4)), hidden.new_empty(k if a.i[2] else 0, dtype=torch.int64),
                *grads_fake(hidden, weight, a.i[3:6], a.dtype)]


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


class ProbsChunkedHead(_ProbsRows):
    """``method="chunked"``: the kind ``probs`` (``kinds.py``: one node per loop whatever
    the token count; ``chunk_size`` None for the rule)."""
    grads_in_forward = True

    def __init__(self, impl, chunk_size: Optional[int], logits: str = "float32"):
        self.chunk_size, self.words = chunk_size or 0, f"{impl.NAME},{logits}"

    def forward(self, hidden, weight, bias, q, w, opts: LossOptions, stats: bool):
        *rows, predicted = kinds.forward("probs", [hidden, weight, bias, q, w],
                                         *loss_args(opts, self.chunk_size, stats), self.words)
        return (*rows, predicted if stats else None)

    def grads(self, hidden, weight, bias, q, w, opts: LossOptions, grad_row, z_grad_row, needs, accum_dtype,
              saved=None, stats: bool = False):
        """``saved = (lse, lse_lo, a)`` from a forward: only the backward (each chunk recomputed);
        None: the forward too, each chunk's gradient formed right after its loss."""
        lse, lse_lo, a = (None,) * 3 if saved is None else saved
        loss, lse_o, lo_o, a_o, predicted, g_h, g_w, g_b = kinds.backward(
            "probs", [hidden, weight, bias, q, w, grad_row, z_grad_row, lse, lse_lo, a],
            *loss_args(opts, self.chunk_size, stats, *needs), self.words, accum_dtype)
        grads = tuple(g if need else None for g, need in zip((g_h, g_w, g_b), needs))
        if saved is not None:
            return (None, lse, lse_lo, a, None, *grads)
        return (loss, lse_o, lo_o, a_o, predicted if stats else None, *grads)


class ProbsTiledHead(_ProbsRows):
    grads_in_forward = False

    def forward(self, hidden, weight, bias, q, w, opts: LossOptions, stats: bool):
        return probs_tiled_forward(hidden, weight, bias, q, w, opts, stats)

    def grads(self, hidden, weight, bias, q, w, opts: LossOptions, grad_row, z_grad_row, needs, accum_dtype,
              saved=None, stats: bool = False):
        if saved is None:
            raise AssertionError("ProbsTiledHead.grads recomputes from a forward's saved statistics")
        lse, lse_lo, a = saved
        grads = probs_tiled_backward(hidden, weight, bias, q, w, lse, lse_lo, a, grad_row,
                                               grad_lse(lse, z_grad_row, opts), opts, needs, accum_dtype)
        return (None, lse, lse_lo, a, None, *grads)


def make_probs_head(impl, method: str, n_rows: int, hidden_size: int, vocab_size: int,
                   chunk_size: Optional[int], device_type: str, logits: str = "float32"):
    """The head for ``method`` ("auto" resolved by ``head.resolve_method``)."""
    if resolve_method(method) == "tiled":
        return ProbsTiledHead()
    return ProbsChunkedHead(impl, chunk_size, logits)   # rows decided inside the loop's op
