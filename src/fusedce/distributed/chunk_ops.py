"""The vocab-parallel linear ops' chunk loops as one op each, so that a tracer sees one node per loop, as
``lm_head/loop.py`` for the single-process ops."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.opaque import opaque_op
from fusedce.core.options import LossOptions
from fusedce.distributed.layout import VocabLayout
from fusedce.distributed.kclass_rows import gather_local, grad_of_slice, local_entries
from fusedce.distributed.shard_rows import Columns, shard_forward, shard_grad
from fusedce.distributed.soft_rows import SoftPartials, SoftSlice
from fusedce.lm_head.loop import backprop_chunks, chunk_buffer, logits_chunk, or_empty, rows_of
from fusedce.rl.kclass_head import entries

Tensor = torch.Tensor
Opts = list[Optional[Tensor]]


def _f32(like: Tensor, *shape) -> Tensor:
    return like.new_empty(shape, dtype=torch.float32)


class _CE:
    """Class-index targets. Forward rowwise ``[target]``, shared ``[w]``, ``flag`` = the entropy column; outputs
    ``key`` (n,) int64, ``zmax`` (n,) fp32, ``sums`` (n, k) fp32 (``shard_rows.shard_forward``)."""

    @staticmethod
    def columns(shared: Opts, opts: LossOptions, flag: bool) -> Columns:
        return Columns(shared[0] is not None, opts.label_smoothing > 0.0, flag)

    @classmethod
    def outputs(cls, hidden, rowwise: Opts, shared: Opts, opts, flag) -> list:
        n = hidden.shape[0]
        return [hidden.new_empty(n, dtype=torch.int64), _f32(hidden, n),
                _f32(hidden, n, cls.columns(shared, opts, flag).k)]

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


class _Soft:
    """Probability targets. Forward rowwise ``[q (n, V_r)]``, shared ``[w]``, ``flag`` = stats; outputs
    ``SoftPartials``' ``lse``, ``lo`` (n,) fp32, ``sums`` (n, 4) fp32 and ``keys`` (n, 2) int64 ((0,) without
    stats)."""

    @staticmethod
    def outputs(hidden, rowwise: Opts, shared: Opts, opts, flag) -> list:
        n = hidden.shape[0]
        keys = hidden.new_empty((n, 2) if flag else (0,), dtype=torch.int64)
        return [_f32(hidden, n), _f32(hidden, n), hidden.new_zeros(n, 4, dtype=torch.float32), keys]

    @staticmethod
    def state(impl, layout, opts):
        return SoftSlice(impl, layout, opts)

    @staticmethod
    def fill(part, x, c, outs, rows: Opts, shared: Opts, layout, opts, flag) -> None:
        lse, lo, sums, keys = outs
        part.fill(SoftPartials(lse, lo, sums, keys if flag else None), c, x, rows[0], shared[0])

    @staticmethod
    def grad(part, x, rows: Opts, shared: Opts, layout, opts) -> Tensor:
        q, lse, lse_lo, mass, grad_row, grad_lse = rows
        return part.grad_(x, q, shared[0], lse, lse_lo, mass, grad_row, grad_lse)


KINDS = {"ce": _CE, "kclass": _KClass, "soft": _Soft}


def _setup(kind, start, size, n_classes, ignore_index, scalars, backend, device):
    from fusedce import backends
    layout = VocabLayout(start, size, n_classes, None)   # the body runs no collective: no group
    opts = LossOptions.from_op_args(ignore_index, scalars)
    k = KINDS[kind]
    return k, layout, opts, k.state(backends.get(backend, device), layout, opts)


def _sliced(tensors: Opts, c: slice) -> Opts:
    return [None if t is None else t[c] for t in tensors]


# ---------------------------------------------------------------- forward: the partial statistics

@opaque_op("fusedce_dist::forward_chunks", mutates_args=(), observable=True)
def _forward_op(kind: str, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], rowwise: Opts, shared: Opts,
                start: int, size: int, n_classes: int, ignore_index: int, scalars: list[float], backend: str,
                chunk_size: int, flag: bool) -> list[Tensor]:
    k, layout, opts, state = _setup(kind, start, size, n_classes, ignore_index, scalars, backend, hidden.device)
    outs = k.outputs(hidden, rowwise, shared, opts, flag)
    n = hidden.shape[0]
    rows = rows_of(chunk_size, hidden, weight)
    buffer = chunk_buffer(n, rows, weight, hidden.dtype)
    for s in range(0, n, rows):
        c = slice(s, s + rows)
        x = logits_chunk(hidden[c], weight, bias, buffer)   # fp32 from the operands' values
        k.fill(state, x, c, outs, _sliced(rowwise, c), shared, layout, opts, flag)
        del x
    return outs


@_forward_op.register_fake
def _(kind, hidden, weight, bias, rowwise, shared, start, size, n_classes, ignore_index, scalars, backend,
      chunk_size, flag):
    return KINDS[kind].outputs(hidden, rowwise, shared, LossOptions.from_op_args(ignore_index, scalars), flag)


def forward(kind: str, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], rowwise: Opts, shared: Opts,
            layout: VocabLayout, opts: LossOptions, impl, chunk_size: Optional[int], flag: bool) -> list:
    """The kind's per-row partial statistics of this rank's slice over every chunk (see ``KINDS``); the
    caller runs the collectives on them."""
    return _forward_op(kind, hidden, weight, bias, list(rowwise), list(shared), layout.start, layout.size,
                       layout.n_classes, *opts.op_args(), impl.NAME, chunk_size or 0, flag)


# ---------------------------------------------------------------- backward: through the slice and the head

@opaque_op("fusedce_dist::backward_chunks", mutates_args=(), observable=True)
def _backward_op(kind: str, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], rowwise: Opts, shared: Opts,
                 start: int, size: int, n_classes: int, ignore_index: int, scalars: list[float], backend: str,
                 chunk_size: int, needs_hidden: bool, needs_weight: bool, needs_bias: bool,
                 accum_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    k, layout, opts, state = _setup(kind, start, size, n_classes, ignore_index, scalars, backend, hidden.device)

    def slice_grad(c, x):   # the logits' gradient of this rank's slice for the chunk's rows
        return k.grad(state, x, _sliced(rowwise, c), shared, layout, opts)

    g_h, g_w, g_b = backprop_chunks(hidden, weight, bias, rows_of(chunk_size, hidden, weight),
                                    (needs_hidden, needs_weight, needs_bias), accum_dtype, slice_grad)
    return or_empty(g_h, hidden, hidden.dtype), or_empty(g_w, hidden, accum_dtype), or_empty(g_b, hidden, accum_dtype)


@_backward_op.register_fake
def _(kind, hidden, weight, bias, rowwise, shared, start, size, n_classes, ignore_index, scalars, backend,
      chunk_size, needs_hidden, needs_weight, needs_bias, accum_dtype):
    return (hidden.new_empty(hidden.shape if needs_hidden else (0,)),
            weight.new_empty(weight.shape if needs_weight else (0,), dtype=accum_dtype),
            weight.new_empty(weight.shape[0] if needs_bias else 0, dtype=accum_dtype))


def backward(kind: str, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], rowwise: Opts, shared: Opts,
             layout: VocabLayout, opts: LossOptions, impl, chunk_size: Optional[int], needs,
             accum_dtype: torch.dtype) -> tuple:
    """``(grad_hidden, grad_weight, grad_bias)`` of this rank's slice (None where ``needs`` says no;
    ``grad_hidden`` this slice's partial sum, the weight's and bias's in ``accum_dtype``)."""
    g_h, g_w, g_b = _backward_op(kind, hidden, weight, bias, list(rowwise), list(shared), layout.start, layout.size,
                                 layout.n_classes, *opts.op_args(), impl.NAME, chunk_size or 0, *needs, accum_dtype)
    return tuple(t if need else None for t, need in zip((g_h, g_w, g_b), needs))
