"""The PyTorch backend's loops as torch custom ops (namespace ``fusedce_torch``), so that torch.compile sees one opaque
node per loop, as it sees one per Triton launch, instead of unrolling the Python loop into the graph."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.opaque import opaque_op
from fusedce.core.options import LossOptions
from fusedce.core.types import SliceStats
from ..protocol import TiledRows
from .launch import chunk_grad_, chunk_loss, chunk_loss_grad_
from .slices import slice_grad as _slice_grad
from .slices import slice_stats as _slice_stats
from .distill_tiled import tiled_distill as _tiled_distill
from . import probs_tiled as _probs_tiled
from .tiled import TorchTiledCE
from .tiled import invariant_rows as tiled_invariant_rows
from .token_stats import chunk_token_stats

Opt = Optional[torch.Tensor]
Tensor = torch.Tensor


def _f32(like: Tensor, n: int) -> Tensor:
    return like.new_empty(n, dtype=torch.float32)


def _i64(like: Tensor, n: int) -> Tensor:
    return like.new_empty(n, dtype=torch.int64)


def _or_empty(t: Opt, like: Tensor, dtype=torch.float32) -> Tensor:
    return like.new_empty(0, dtype=dtype) if t is None else t


def _none_if_empty(t: Tensor, made: bool) -> Opt:
    return t if made else None


# ---------------------------------------------------------------- row chunks (cross_entropy, chunked, RL)

@opaque_op("fusedce_torch::chunk_loss", mutates_args=())
def _chunk_loss(logits: Tensor, target: Tensor, w: Opt, weight_sum: Opt, ignore_index: int, scalars: list[float],
                stats: bool, entropy: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    out = chunk_loss(logits, target, w, weight_sum, LossOptions.from_op_args(ignore_index, scalars), stats, entropy)
    loss, lse, lse_lo, predicted = out[:4]
    return loss, lse, lse_lo, _or_empty(predicted, logits, torch.int64), out[4] if entropy else _f32(logits, 0)


@_chunk_loss.register_fake
def _(logits, target, w, weight_sum, ignore_index, scalars, stats, entropy):
    n = logits.shape[0]
    return _f32(logits, n), _f32(logits, n), _f32(logits, n), _i64(logits, n if stats else 0), \
        _f32(logits, n if entropy else 0)


@opaque_op("fusedce_torch::chunk_loss_grad_inplace", mutates_args=("logits",))
def _chunk_loss_grad(logits: Tensor, target: Tensor, w: Opt, weight_sum: Opt, grad_row: Tensor, z_grad_row: Tensor,
                     ignore_index: int, scalars: list[float],
                     stats: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    opts = LossOptions.from_op_args(ignore_index, scalars)
    loss, lse, lse_lo, predicted, token_weight = chunk_loss_grad_(logits, target, w, weight_sum, grad_row, z_grad_row,
                                                                  opts, stats)
    return loss, lse, lse_lo, _or_empty(predicted, logits, torch.int64), _or_empty(token_weight, logits)


@_chunk_loss_grad.register_fake
def _(logits, target, w, weight_sum, grad_row, z_grad_row, ignore_index, scalars, stats):
    n = logits.shape[0]
    scaling = LossOptions.from_op_args(ignore_index, scalars).use_token_scaling
    return _f32(logits, n), _f32(logits, n), _f32(logits, n), _i64(logits, n if stats else 0), \
        _f32(logits, n if scaling else 0)


def rows_loss_grad_(logits, target, w, weight_sum, grad_row, z_grad_row, opts: LossOptions, stats: bool):
    """``launch.chunk_loss_grad_`` as one op: ``(loss, lse, lse_lo, predicted, token_weight)`` (None where not
    made), the gradient written into ``logits``."""
    loss, lse, lse_lo, predicted, token_weight = _chunk_loss_grad(logits, target, w, weight_sum, grad_row,
                                                                  z_grad_row, *opts.op_args(), stats)
    return loss, lse, lse_lo, _none_if_empty(predicted, stats), _none_if_empty(token_weight, opts.use_token_scaling)


@opaque_op("fusedce_torch::chunk_grad_inplace", mutates_args=("logits",))
def _chunk_grad_inplace(logits: Tensor, target: Tensor, w: Opt, weight_sum: Opt, lse: Tensor, lse_lo: Tensor,
                        grad_row: Tensor, grad_lse: Opt, ignore_index: int, scalars: list[float],
                        grad_entropy: Opt = None, entropy: Opt = None) -> None:
    chunk_grad_(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse,
                LossOptions.from_op_args(ignore_index, scalars), grad_entropy=grad_entropy, entropy=entropy)


@_chunk_grad_inplace.register_fake
def _(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, ignore_index, scalars, grad_entropy=None,
      entropy=None):
    return None


@opaque_op("fusedce_torch::chunk_grad_out", mutates_args=("out",))
def _chunk_grad_out(logits: Tensor, out: Tensor, target: Tensor, w: Opt, weight_sum: Opt, lse: Tensor,
                    lse_lo: Tensor, grad_row: Tensor, grad_lse: Opt, ignore_index: int, scalars: list[float],
                    grad_entropy: Opt = None, entropy: Opt = None) -> None:
    chunk_grad_(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse,
                LossOptions.from_op_args(ignore_index, scalars), out=out, grad_entropy=grad_entropy, entropy=entropy)


@_chunk_grad_out.register_fake
def _(logits, out, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, ignore_index, scalars,
      grad_entropy=None, entropy=None):
    return None


def rows_loss(logits, target, w, weight_sum, opts: LossOptions, stats: bool = True, entropy: bool = False):
    """``cross_entropy.chunk_loss`` as one op: ``(loss, lse, lse_lo, predicted)`` (predicted None without
    ``stats``), with ``entropy`` a fifth element."""
    loss, lse, lse_lo, predicted, ent = _chunk_loss(logits, target, w, weight_sum,
                                                                           *opts.op_args(), stats, entropy)
    out = (loss, lse, lse_lo, _none_if_empty(predicted, stats))
    return out + (ent,) if entropy else out


def rows_grad_(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, opts: LossOptions, grad_entropy=None,
               entropy=None, out=None) -> Tensor:
    """``cross_entropy.chunk_grad_`` as one op: the gradient written into ``out`` (default ``logits``),
    which is returned."""
    if grad_entropy is None:
        entropy = None
    if out is None or out is logits:
        _chunk_grad_inplace(logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse,
                                                   *opts.op_args(), grad_entropy, entropy)
        return logits
    _chunk_grad_out(logits, out, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse,
                                           *opts.op_args(), grad_entropy, entropy)
    return out


@opaque_op("fusedce_torch::chunk_token_stats", mutates_args=())
def _chunk_token_stats(logits: Tensor, target: Tensor, lse: Tensor, lse_lo: Tensor, ignore_index: int,
                       scalars: list[float]) -> tuple[Tensor, Tensor, Tensor]:
    return chunk_token_stats(logits, target, lse, lse_lo, LossOptions.from_op_args(ignore_index, scalars))


@_chunk_token_stats.register_fake
def _(logits, target, lse, lse_lo, ignore_index, scalars):
    n = logits.shape[0]
    return _f32(logits, n), _f32(logits, n), logits.new_empty(n, dtype=torch.bool)


def rows_token_stats(logits, target, lse, lse_lo, opts: LossOptions):
    """``token_stats.chunk_token_stats`` as one op: ``(log_sum_sq_probs, mean_logits, is_top1)``."""
    return tuple(_chunk_token_stats(logits, target, lse, lse_lo, *opts.op_args()))


# ---------------------------------------------------------------- method="tiled"

@opaque_op("fusedce_torch::tiled_forward", mutates_args=())
def _tiled_forward(hidden: Tensor, weight: Tensor, bias: Opt, target: Tensor, w: Opt, weight_sum: Opt,
                   ignore_index: int, scalars: list[float], stats: bool, entropy: bool, token_stats: bool,
                   batch_invariant: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    rows = TorchTiledCE.forward(hidden, weight, bias, target, w, weight_sum,
                                LossOptions.from_op_args(ignore_index, scalars), stats, entropy, token_stats,
                                batch_invariant)
    extra = rows.token_stats if token_stats else (hidden.new_empty(0, dtype=torch.float32),
                                                   hidden.new_empty(0, dtype=torch.float32),
                                                   hidden.new_empty(0, dtype=torch.bool))
    return (*rows[:5], _or_empty(rows.entropy, hidden), *extra)


@_tiled_forward.register_fake
def _(hidden, weight, bias, target, w, weight_sum, ignore_index, scalars, stats, entropy, token_stats,
      batch_invariant):
    n = hidden.shape[0]
    k = n if token_stats else 0
    return (*(_f32(hidden, n) for _ in range(3)), _i64(hidden, n), _f32(hidden, n), _f32(hidden, n if entropy else 0),
            _f32(hidden, k), _f32(hidden, k), hidden.new_empty(k, dtype=torch.bool))


@opaque_op("fusedce_torch::tiled_backward", mutates_args=())
def _tiled_backward(hidden: Tensor, weight: Tensor, bias: Opt, target: Tensor, w: Opt, weight_sum: Opt, lse: Tensor,
                    lse_lo: Tensor, grad_row: Tensor, grad_lse: Opt, ignore_index: int, scalars: list[float],
                    needs_hidden: bool, needs_weight: bool, needs_bias: bool, accum_dtype: torch.dtype,
                    grad_entropy: Opt, entropy: Opt, batch_invariant: bool) -> tuple[Tensor, Tensor, Tensor]:
    grads = TorchTiledCE.backward(hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse,
                                  LossOptions.from_op_args(ignore_index, scalars),
                                  (needs_hidden, needs_weight, needs_bias), accum_dtype, grad_entropy, entropy,
                                  batch_invariant=batch_invariant)
    return tuple(_or_empty(g, hidden, dtype) for g, dtype in zip(grads, (hidden.dtype, accum_dtype, accum_dtype)))


@_tiled_backward.register_fake
def _(hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, ignore_index, scalars,
      needs_hidden, needs_weight, needs_bias, accum_dtype, grad_entropy, entropy, batch_invariant):
    return (hidden.new_empty(hidden.shape if needs_hidden else (0,)),
            weight.new_empty(weight.shape if needs_weight else (0,), dtype=accum_dtype),
            weight.new_empty(weight.shape[0] if needs_bias else 0, dtype=accum_dtype))


class TorchTiledOps:
    """``TiledCE`` (``backends/protocol.py``) through the two ops above."""

    invariant_rows = staticmethod(tiled_invariant_rows)

    @staticmethod
    def forward(hidden, weight, bias, target, w, weight_sum, opts: LossOptions, stats: bool,
                entropy: bool = False, token_stats: bool = False, batch_invariant: bool = False) -> TiledRows:
        *rows, ent, lssp, mean, top1 = _tiled_forward(
            hidden, weight, bias, target, w, weight_sum, *opts.op_args(), stats, entropy, token_stats,
            batch_invariant)
        return TiledRows(*rows, _none_if_empty(ent, entropy), (lssp, mean, top1) if token_stats else None)

    @staticmethod
    def backward(hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, opts: LossOptions,
                 needs, accum_dtype, grad_entropy=None, entropy=None, deterministic=False, batch_invariant=False):
        # deterministic: nothing to select, the loop has no atomics (``TorchTiledCE.backward``)
        grads = _tiled_backward(
            hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, *opts.op_args(),
            *needs, accum_dtype, grad_entropy, None if grad_entropy is None else entropy, batch_invariant)
        return tuple(_none_if_empty(g, need) for g, need in zip(grads, needs))


TORCH_TILED = TorchTiledOps()


# ---------------------------------------------------------------- vocabulary slices (vocab parallelism)

@opaque_op("fusedce_torch::slice_stats", mutates_args=())
def _slice_stats_op(logits: Tensor, target: Tensor, weight: Opt, ignore_index: int, scalars: list[float],
                    col_start: int, entropy: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    st = _slice_stats(logits, target, weight, LossOptions.from_op_args(ignore_index, scalars), col_start, entropy)
    return (*st[:5], _or_empty(st.zsum, logits), _or_empty(st.tsum, logits))


@_slice_stats_op.register_fake
def _(logits, target, weight, ignore_index, scalars, col_start, entropy):
    n = logits.shape[0]
    smoothing = LossOptions.from_op_args(ignore_index, scalars).label_smoothing > 0.0
    return _f32(logits, n), _i64(logits, n), _f32(logits, n), _f32(logits, n), _f32(logits, n), \
        _f32(logits, n if smoothing else 0), _f32(logits, n if entropy else 0)


@opaque_op("fusedce_torch::slice_grad", mutates_args=())
def _slice_grad_op(logits: Tensor, target: Tensor, weight: Opt, weight_sum: Opt, target_weight: Opt, lse: Tensor,
                   lse_lo: Tensor, grad_row: Tensor, grad_lse: Opt, ignore_index: int, scalars: list[float],
                   col_start: int, n_total: int, grad_entropy: Opt, entropy: Opt) -> Tensor:
    return _slice_grad(logits, target, weight, weight_sum, target_weight, lse, lse_lo, grad_row, grad_lse,
                       LossOptions.from_op_args(ignore_index, scalars), col_start, n_total, grad_entropy, entropy)


@_slice_grad_op.register_fake
def _(logits, target, weight, weight_sum, target_weight, lse, lse_lo, grad_row, grad_lse, ignore_index, scalars,
      col_start, n_total, grad_entropy, entropy):
    return logits.new_empty(logits.shape)


def slice_stats(logits, target, weight, opts: LossOptions, col_start: int, entropy: bool = False) -> SliceStats:
    """``slices.slice_stats`` as one op."""
    *st, zsum, tsum = _slice_stats_op(logits, target, weight, *opts.op_args(), col_start,
                                                          entropy)
    return SliceStats(*st, _none_if_empty(zsum, opts.label_smoothing > 0.0), _none_if_empty(tsum, entropy))


def slice_grad(logits, target, weight, weight_sum, target_weight, lse, lse_lo, grad_row, grad_lse,
               opts: LossOptions, col_start: int, n_total: int, grad_entropy: Opt = None,
               entropy: Opt = None) -> Tensor:
    """``slices.slice_grad`` as one op (``grad_entropy`` with the global ``entropy``: its term too)."""
    return _slice_grad_op(logits, target, weight, weight_sum, target_weight, lse, lse_lo,
                                              grad_row, grad_lse, *opts.op_args(), col_start, n_total,
                                              grad_entropy, None if grad_entropy is None else entropy)


# ---------------------------------------------------------------- tiled distillation


def _empty_f32(like: Tensor) -> Tensor:
    return like.new_empty(0, dtype=torch.float32)


@opaque_op("fusedce_torch::tiled_distill", mutates_args=())
def _tiled_distill_op(hs: Tensor, ws: Tensor, bs: Opt, ht: Tensor, wt: Tensor, bt: Opt, target: Opt,
                      grad_factor: Opt, beta: float, temperature: float, hard_label_weight: float, ignore_index: int,
                      student_softcap: Optional[float], teacher_softcap: Optional[float],
                      deterministic: bool, batch_invariant: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    loss, g_h, g_w, g_b = _tiled_distill(hs, ws, bs, ht, wt, bt, target, grad_factor, beta=beta,
                                         temperature=temperature, hard_label_weight=hard_label_weight,
                                         ignore_index=ignore_index, student_softcap=student_softcap,
                                         teacher_softcap=teacher_softcap, deterministic=deterministic,
                                         batch_invariant=batch_invariant)
    return (loss, _empty_f32(hs) if g_h is None else g_h, _empty_f32(hs) if g_w is None else g_w,
            _empty_f32(hs) if g_b is None else g_b)


@_tiled_distill_op.register_fake
def _(hs, ws, bs, ht, wt, bt, target, grad_factor, beta, temperature, hard_label_weight, ignore_index,
      student_softcap, teacher_softcap, deterministic, batch_invariant):
    n = hs.shape[0]
    loss = hs.new_empty(n, dtype=torch.float32)
    if grad_factor is None:
        return loss, _empty_f32(hs), _empty_f32(hs), _empty_f32(hs)
    g_b = _empty_f32(hs) if bs is None else hs.new_empty(ws.shape[0], dtype=torch.float32)
    return loss, torch.empty_like(hs), hs.new_empty(ws.shape, dtype=torch.float32), g_b


def tiled_distill(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                  target, grad_factor, *, beta: float, temperature: float, hard_label_weight: float,
                  ignore_index: int, student_softcap: Optional[float], teacher_softcap: Optional[float],
                  deterministic: bool = False, batch_invariant: bool = False):
    """``distill_tiled.tiled_distill`` (same arguments and results) through the custom op."""
    loss, g_h, g_w, g_b = _tiled_distill_op(student_hidden, student_weight, student_bias, teacher_hidden,
                                            teacher_weight, teacher_bias, target, grad_factor, float(beta),
                                            float(temperature), float(hard_label_weight), int(ignore_index),
                                            None if student_softcap is None else float(student_softcap),
                                            None if teacher_softcap is None else float(teacher_softcap),
                                            bool(deterministic), bool(batch_invariant))
    if grad_factor is None:
        return loss, None, None, None
    return loss, g_h, g_w, (None if student_bias is None else g_b)


tiled_distill.invariant_rows = tiled_invariant_rows   # its token blocks are ``tiled.py``'s (``tuning.tile_sizes``)


# ---------------------------------------------------------------- probability targets, method="tiled"

@opaque_op("fusedce_torch::probs_tiled_forward", mutates_args=(), observable=True)
def _probs_tiled_forward_op(hidden: Tensor, weight: Tensor, bias: Opt, q: Tensor, w: Opt, ignore_index: int,
                           scalars: list[float], stats: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    *rows, predicted = _probs_tiled.probs_tiled_forward(hidden, weight, bias, q, w,
                                                     LossOptions.from_op_args(ignore_index, scalars), stats)
    return (*rows, _or_empty(predicted, hidden, torch.int64))


@_probs_tiled_forward_op.register_fake
def _(hidden, weight, bias, q, w, ignore_index, scalars, stats):
    n = hidden.shape[0]
    return (*(_f32(hidden, n) for _ in range(4)), _i64(hidden, n if stats else 0))


def probs_tiled_forward(hidden, weight, bias, q, w, opts: LossOptions, stats: bool):
    """``probs_tiled.probs_tiled_forward`` (same arguments and results) as one op."""
    *rows, predicted = _probs_tiled_forward_op(hidden, weight, bias, q, w, *opts.op_args(), stats)
    return (*rows, _none_if_empty(predicted, stats))


@opaque_op("fusedce_torch::probs_tiled_backward", mutates_args=(), observable=True)
def _probs_tiled_backward_op(hidden: Tensor, weight: Tensor, bias: Opt, q: Tensor, w: Opt, lse: Tensor, lse_lo: Tensor,
                            a: Tensor, grad_row: Tensor, grad_lse: Opt, ignore_index: int, scalars: list[float],
                            needs_hidden: bool, needs_weight: bool, needs_bias: bool, accum_dtype: torch.dtype
                            ) -> tuple[Tensor, Tensor, Tensor]:
    needs = (needs_hidden, needs_weight, needs_bias)
    grads = _probs_tiled.probs_tiled_backward(hidden, weight, bias, q, w, lse, lse_lo, a, grad_row, grad_lse,
                                            LossOptions.from_op_args(ignore_index, scalars), needs, accum_dtype)
    return tuple(_or_empty(g, hidden, dtype) for g, dtype in zip(grads, (hidden.dtype, accum_dtype, accum_dtype)))


@_probs_tiled_backward_op.register_fake
def _(hidden, weight, bias, q, w, lse, lse_lo, a, grad_row, grad_lse, ignore_index, scalars, needs_hidden,
      needs_weight, needs_bias, accum_dtype):
    return (hidden.new_empty(hidden.shape if needs_hidden else (0,)),
            weight.new_empty(weight.shape if needs_weight else (0,), dtype=accum_dtype),
            weight.new_empty(weight.shape[0] if needs_bias else 0, dtype=accum_dtype))


def probs_tiled_backward(hidden, weight, bias, q, w, lse, lse_lo, a, grad_row, grad_lse, opts: LossOptions, needs,
                        accum_dtype):
    """``probs_tiled.probs_tiled_backward`` (same arguments and results) as one op."""
    grads = _probs_tiled_backward_op(hidden, weight, bias, q, w, lse, lse_lo, a, grad_row, grad_lse, *opts.op_args(),
                                    *needs, accum_dtype)
    return tuple(_none_if_empty(g, need) for g, need in zip(grads, needs))
