"""The vocab-parallel linear ops' chunk loops as loop kinds (``lm_head/kinds.py``: one node per loop whatever the
token count); the callers run the collectives on their outputs."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.options import LossOptions
from fusedce.distributed.layout import VocabLayout
from fusedce.distributed.kclass_rows import gather_local, grad_of_slice, local_entries
from fusedce.distributed.shard_rows import Columns, shard_forward, shard_grad
from fusedce.distributed.probs_rows import ProbsPartials, ProbsSlice
from fusedce.lm_head import kinds
from fusedce.lm_head.kinds import Args, loss_args, register
from fusedce.lm_head.loop import backprop_chunks, chunk_buffer, f32, grads_fake, logits_chunk, or_empty, rows_of
from fusedce.rl.kclass_head import entries

Tensor = torch.Tensor
Opts = list[Optional[Tensor]]


class _Slice:
    """A kind on this rank's vocabulary slice. Tensors ``hidden, weight, bias``, then ``n`` row-wise tensors (sliced
    with the chunk) and the shared ones; ints ``ignore_index, start, size, n_classes, chunk_size, n``, then
    ``flag`` (forward) or ``needs`` x3 (backward); words the backend; the backward's dtype the accumulation's.
    A subclass gives ``outputs``, ``state``, ``fill`` (forward) and ``grad`` (backward)."""

    @classmethod
    def _setup(cls, a: Args):
        from fusedce import backends
        hidden, weight, bias = a.t[:3]
        n = a.i[5]
        rowwise, shared = a.t[3:3 + n], a.t[3 + n:]
        layout = VocabLayout(*a.i[1:4], None)   # the body runs no collective: no group
        opts = LossOptions.from_op_args(a.i[0], a.f)
        state = cls.state(backends.get(a.words, hidden.device), layout, opts)
        return hidden, weight, bias, rowwise, shared, layout, opts, state, rows_of(a.i[4], hidden, weight)

    @classmethod
    def forward(cls, a: Args) -> list:
        hidden, weight, bias, rowwise, shared, layout, opts, state, rows = cls._setup(a)
        outs = cls.outputs(hidden, rowwise, shared, opts, bool(a.i[6]))
        n = hidden.shape[0]
        buffer = chunk_buffer(n, rows, weight, hidden.dtype)
        for s in range(0, n, rows):
            c = slice(s, s + rows)
            x = logits_chunk(hidden[c], weight, bias, buffer)   # fp32 from the operands' values
            cls.fill(state, x, c, outs, _sliced(rowwise, c), shared, layout, opts, bool(a.i[6]))
            del x
        return outs

    @classmethod
    def forward_fake(cls, a: Args) -> list:
        n = a.i[5]
        return cls.outputs(a.t[0], a.t[3:3 + n], a.t[3 + n:], a.opts(), bool(a.i[6]))

    @classmethod
    def backward(cls, a: Args) -> list:
        hidden, weight, bias, rowwise, shared, layout, opts, state, rows = cls._setup(a)

        def slice_grad(c, x):   # the logits' gradient of this rank's slice for the chunk's rows
            return cls.grad(state, x, _sliced(rowwise, c), shared, layout, opts)

        g_h, g_w, g_b = backprop_chunks(hidden, weight, bias, rows, tuple(map(bool, a.i[6:9])), a.dtype, slice_grad)
        return [or_empty(g_h, hidden, hidden.dtype), or_empty(g_w, hidden, a.dtype), or_empty(g_b, hidden, a.dtype)]

    @staticmethod
    def backward_fake(a: Args) -> list:
        return grads_fake(a.t[0], a.t[1], a.i[6:9], a.dtype)


@register("dist_ce")
class _CE(_Slice):
    """Class-index targets. Forward rowwise ``[target]``, shared ``[w]``, ``flag`` = the entropy column; outputs
    ``key`` (n,) int64, ``zmax`` (n,) fp32, ``sums`` (n, k) fp32 (``shard_rows.shard_forward``)."""

    @staticmethod
    def columns(shared: Opts, opts: LossOptions, flag: bool) -> Columns:
        return Columns(shared[0] is not None, opts.label_smoothing > 0.0, flag)

    @classmethod
    def outputs(cls, hidden, rowwise: Opts, shared: Opts, opts, flag) -> list:
        n = hidden.shape[0]
        return [hidden.new_empty(n, dtype=torch.int64), f32(hidden, n),
                f32(hidden, n, cls.columns(shared, opts, flag).k)]

    @staticmethod
    def state(impl, layout, opts):
        return impl

    @classmethod
    def fill(cls, impl, x, c, outs, rows: Opts, shared: Opts, layout, opts, flag) -> None:
        key, zmax, sums = outs
        key[c], zmax[c], sums[c] = shard_forward(impl, x, rows[0], shared[0], layout, opts,
                                                 cls.columns(shared, opts, flag))

    @staticmethod
    def grad(impl, x, rows: Opts, shared: Opts, layout, opts) -> Tensor:
        target, w_t, lse, lse_lo, grad_row, grad_lse, grad_entropy, entropy = rows
        return shard_grad(impl, x, target, shared[0], shared[1], w_t, lse, lse_lo, grad_row, grad_lse, layout,
                          opts, grad_entropy=grad_entropy, entropy=entropy)


@register("dist_kclass")
class _KClass(_CE):
    """K classes per token. Forward rowwise ``[target (n, K)]``, ``flag`` = the entropy column; outputs as ``_CE``'s
    plus ``x`` (n, K) fp32, the logits of the local entries (0 elsewhere)."""

    @classmethod
    def outputs(cls, hidden, rowwise: Opts, shared: Opts, opts, flag) -> list:
        return super().outputs(hidden, rowwise, [None], opts, flag) + [hidden.new_zeros(rowwise[0].shape,
                                                                                         dtype=torch.float32)]

    @classmethod
    def fill(cls, impl, x, c, outs, rows: Opts, shared: Opts, layout, opts, flag) -> None:
        key, zmax, sums, gathered = outs
        e = entries(rows[0], opts, layout.n_classes)
        key[c], zmax[c], sums[c] = shard_forward(impl, x, e.rep, None, layout, opts, cls.columns([None], opts, flag))
        gathered[c] = gather_local(x, local_entries(e, layout))

    @staticmethod
    def grad(impl, x, rows: Opts, shared: Opts, layout, opts) -> Tensor:
        target, g, G, lse, lse_lo, k, entropy = rows
        e = entries(target, opts, layout.n_classes)
        return grad_of_slice(impl, x, e, local_entries(e, layout), g, G, lse, lse_lo, k, entropy, layout, opts)


@register("dist_probs")
class _Probs(_Slice):
    """Probability targets. Forward rowwise ``[q (n, V_r)]``, shared ``[w]``, ``flag`` = stats; outputs
    ``ProbsPartials``' ``lse``, ``lo`` (n,) fp32, ``sums`` (n, 4) fp32 and ``keys`` (n, 2) int64 ((0,) without
    stats)."""

    @staticmethod
    def outputs(hidden, rowwise: Opts, shared: Opts, opts, flag) -> list:
        n = hidden.shape[0]
        keys = hidden.new_empty((n, 2) if flag else (0,), dtype=torch.int64)
        return [f32(hidden, n), f32(hidden, n), hidden.new_zeros(n, 4, dtype=torch.float32), keys]

    @staticmethod
    def state(impl, layout, opts):
        return ProbsSlice(impl, layout, opts)

    @staticmethod
    def fill(part, x, c, outs, rows: Opts, shared: Opts, layout, opts, flag) -> None:
        lse, lo, sums, keys = outs
        part.fill(ProbsPartials(lse, lo, sums, keys if flag else None), c, x, rows[0], shared[0])

    @staticmethod
    def grad(part, x, rows: Opts, shared: Opts, layout, opts) -> Tensor:
        q, lse, lse_lo, mass, grad_row, grad_lse = rows
        return part.grad_(x, q, shared[0], lse, lse_lo, mass, grad_row, grad_lse)


def _sliced(tensors: Opts, c: slice) -> Opts:
    return [None if t is None else t[c] for t in tensors]


def _args(kind: str, hidden, weight, bias, rowwise: Opts, shared: Opts, layout: VocabLayout, opts: LossOptions,
          impl, chunk_size: Optional[int], *flags) -> tuple:
    ints, floats = loss_args(opts, layout.start, layout.size, layout.n_classes, chunk_size or 0, len(rowwise), *flags)
    return "dist_" + kind, [hidden, weight, bias, *rowwise, *shared], ints, floats, impl.NAME


def forward(kind: str, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], rowwise: Opts, shared: Opts,
            layout: VocabLayout, opts: LossOptions, impl, chunk_size: Optional[int], flag: bool) -> list:
    """The per-row partial statistics of this rank's slice over every chunk (``kind``: "ce", "kclass" or
    "probs"); the caller runs the collectives on them."""
    return kinds.forward(*_args(kind, hidden, weight, bias, rowwise, shared, layout, opts, impl, chunk_size, flag))


def backward(kind: str, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], rowwise: Opts, shared: Opts,
             layout: VocabLayout, opts: LossOptions, impl, chunk_size: Optional[int], needs,
             accum_dtype: torch.dtype) -> tuple:
    """``(grad_hidden, grad_weight, grad_bias)`` of this rank's slice (None where ``needs`` says no;
    ``grad_hidden`` this slice's partial sum, the weight's and bias's in ``accum_dtype``)."""
    g = kinds.backward(*_args(kind, hidden, weight, bias, rowwise, shared, layout, opts, impl, chunk_size, *needs),
                       accum_dtype)
    return tuple(t if need else None for t, need in zip(g, needs))
