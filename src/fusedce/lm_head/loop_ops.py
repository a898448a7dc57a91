"""The chunk loops of the LM head as one op each, so that a tracer sees one node per loop (issue 27 item 3).

Why: a chunk loop is ``for s in range(0, n, rows)`` over the token count ``n``. Traced by Dynamo with a
symbolic ``n`` (``torch.compile(dynamic=True)``, ``mark_dynamic``), the ``range`` needs a concrete ``n``, so
Dynamo specialized on it: one compilation per distinct token count (and, after eight, a silent fall-back to
eager), a ``ConstraintViolationError`` under ``mark_dynamic``, and compile time growing with the chunk count
(each iteration a copy of the chunk's ops in the graph). Here each loop is a custom op (``core/opaque.py``:
plain eager calls run the body directly, as before) whose fake implementation gives the output shapes from
the inputs' (symbolic) ones; the body runs eagerly on the real tensors, so the graph is the same for every
``n`` and the chunk size is decided there, from the real ``n``, by the eager rule (``chunk_rule.chunk_rows``):
compiled and eager calls make the same chunks, hence the same bits.

Ops (namespace ``fusedce_lm``; ``<options>`` = ``ignore_index: int, scalars: float[]``,
``LossOptions.op_args``; ``backend`` the backend's ``NAME``, whose ``CHUNK_CE`` runs each chunk;
``chunk_size`` 0 for the rule; ``logits`` ``chunked.logits_dtype``'s choice; an output the call does not
make is a (0,) tensor, mapped back to None by the entry points):

- ``chunked_loss``: ``chunked.loss_only`` (``ChunkedHead.forward``);
- ``chunked_grads``: ``chunked.grads`` (``ChunkedHead.grads``: the forward with its gradients, or the
  backward from saved statistics; a saved input is never returned, the entry point passes it through);
- ``chunked_token_stats``: the RL forward with TRL's statistics (``rl/linear_head.py``).

No autograd formula: the autograd Functions that call them differentiate through ``chunked_grads``.
"""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.opaque import opaque_op
from fusedce.core.options import LossOptions
from . import chunked as loop
from .chunk_rule import chunk_rows

Opt = Optional[torch.Tensor]
Tensor = torch.Tensor


def chunk_ce(backend: str, device: torch.device):
    """The ``ChunkCE`` of the backend named ``backend`` (``fusedce.backends.get``)."""
    from fusedce import backends
    return backends.get(backend, device).CHUNK_CE


def rows_of(chunk_size: int, hidden: Tensor, weight: Tensor) -> int:
    """``chunk_size``, or the rule's rows (``chunk_rule.chunk_rows``) for 0 / None."""
    return chunk_size or chunk_rows(hidden.shape[0], hidden.shape[1], weight.shape[0], hidden.device.type)


def _empty(like: Tensor, dtype=torch.float32) -> Tensor:
    return like.new_empty(0, dtype=dtype)


def or_empty(t: Opt, like: Tensor, dtype=torch.float32) -> Tensor:
    """``t``, or a (0,) tensor of ``dtype`` for an output a loop op does not make (ops return tensors)."""
    return _empty(like, dtype) if t is None else t


def f32(like: Tensor, n) -> Tensor:
    """An uninitialized fp32 ``(n,)`` tensor on ``like``'s device (fake implementations' per-row outputs)."""
    return like.new_empty(n, dtype=torch.float32)


# ---------------------------------------------------------------- forward without gradients

@opaque_op("fusedce_lm::chunked_loss", mutates_args=(), observable=True)
def _loss_op(hidden: Tensor, weight: Tensor, bias: Opt, target: Tensor, w: Opt, weight_sum: Opt, ignore_index: int,
             scalars: list[float], backend: str, chunk_size: int, logits: str, stats: bool, entropy: bool
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    opts = LossOptions.from_op_args(ignore_index, scalars)
    loss, lse, lse_lo, predicted, token_weight, ent = loop.loss_only(
        chunk_ce(backend, hidden.device), hidden, weight, bias, target, w, weight_sum, opts,
        rows_of(chunk_size, hidden, weight), stats, entropy, logits)
    return loss, lse, lse_lo, predicted, or_empty(token_weight, hidden), or_empty(ent, hidden)


@_loss_op.register_fake
def _(hidden, weight, bias, target, w, weight_sum, ignore_index, scalars, backend, chunk_size, logits, stats, entropy):
    n = hidden.shape[0]
    scaling = LossOptions.from_op_args(ignore_index, scalars).use_token_scaling
    return (f32(hidden, n), f32(hidden, n), f32(hidden, n), hidden.new_empty(n, dtype=torch.int64),
            f32(hidden, n if scaling else 0), f32(hidden, n if entropy else 0))


def loss_only(ce, chunk_size: Optional[int], hidden, weight, bias, target, w, weight_sum, opts: LossOptions,
              stats: bool, entropy: bool = False, logits: str = "float32"):
    """``chunked.loss_only`` as one op (``chunk_size`` None: the rule's rows)."""
    loss, lse, lse_lo, predicted, token_weight, ent = _loss_op(
        hidden, weight, bias, target, w, weight_sum, *opts.op_args(), ce.NAME, chunk_size or 0, logits, stats,
        entropy)
    return (loss, lse, lse_lo, predicted, token_weight if opts.use_token_scaling else None,
            ent if entropy else None)


# ---------------------------------------------------------------- gradients (with or without the forward)

@opaque_op("fusedce_lm::chunked_grads", mutates_args=(), observable=True)
def _grads_op(hidden: Tensor, weight: Tensor, bias: Opt, target: Tensor, w: Opt, weight_sum: Opt, ignore_index: int,
              scalars: list[float], backend: str, chunk_size: int, logits: str, grad_row: Tensor, z_grad_row: Tensor,
              needs_hidden: bool, needs_weight: bool, needs_bias: bool, accum_dtype: torch.dtype, stats: bool,
              lse: Opt, lse_lo: Opt, token_weight: Opt, grad_entropy: Opt, entropy: Opt
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    opts = LossOptions.from_op_args(ignore_index, scalars)
    saved = None if lse is None else (lse, lse_lo, token_weight, entropy)
    out = loop.grads(chunk_ce(backend, hidden.device), hidden, weight, bias, target, w, weight_sum, opts,
                     rows_of(chunk_size, hidden, weight), grad_row, z_grad_row,
                     (needs_hidden, needs_weight, needs_bias), accum_dtype, saved=saved, stats=stats,
                     grad_entropy=grad_entropy, logits=logits)
    loss, lse_out, lse_lo_out, predicted, tw, g_h, g_w, g_b = out
    if saved is not None:   # never return an input (a custom op may not alias one): the entry point has them
        lse_out = lse_lo_out = None
        if token_weight is not None:
            tw = None
    return (or_empty(loss, hidden), or_empty(lse_out, hidden), or_empty(lse_lo_out, hidden),
            or_empty(predicted, hidden, torch.int64), or_empty(tw, hidden), or_empty(g_h, hidden, hidden.dtype),
            or_empty(g_w, hidden, accum_dtype), or_empty(g_b, hidden, accum_dtype))


@_grads_op.register_fake
def _(hidden, weight, bias, target, w, weight_sum, ignore_index, scalars, backend, chunk_size, logits, grad_row,
      z_grad_row, needs_hidden, needs_weight, needs_bias, accum_dtype, stats, lse, lse_lo, token_weight,
      grad_entropy, entropy):
    n = hidden.shape[0]
    forward = lse is None
    k = n if forward else 0
    scaling = LossOptions.from_op_args(ignore_index, scalars).use_token_scaling
    return (f32(hidden, k), f32(hidden, k), f32(hidden, k), hidden.new_empty(k, dtype=torch.int64),
            f32(hidden, n if scaling and (forward or token_weight is None) else 0),
            hidden.new_empty(hidden.shape if needs_hidden else (0,)),
            weight.new_empty(weight.shape if needs_weight else (0,), dtype=accum_dtype),
            weight.new_empty(weight.shape[0] if needs_bias else 0, dtype=accum_dtype))


def grads(ce, chunk_size: Optional[int], hidden, weight, bias, target, w, weight_sum, opts: LossOptions, grad_row,
          z_grad_row, needs, accum_dtype, saved=None, stats: bool = False, grad_entropy=None,
          logits: str = "float32"):
    """``chunked.grads`` as one op (same arguments and results; ``chunk_size`` None: the rule's rows)."""
    lse, lse_lo, token_weight, entropy = (None,) * 4 if saved is None else saved
    loss, lse_out, lse_lo_out, predicted, tw, g_h, g_w, g_b = _grads_op(
        hidden, weight, bias, target, w, weight_sum, *opts.op_args(), ce.NAME, chunk_size or 0, logits, grad_row,
        z_grad_row, *needs, accum_dtype, stats, lse, lse_lo, token_weight, grad_entropy,
        None if grad_entropy is None else entropy)
    if saved is not None:
        loss = predicted = None
        lse_out, lse_lo_out = lse, lse_lo
        if token_weight is not None:
            tw = token_weight
    if not opts.use_token_scaling:
        tw = None
    return (loss, lse_out, lse_lo_out, predicted, tw, g_h if needs[0] else None, g_w if needs[1] else None,
            g_b if needs[2] else None)


# ---------------------------------------------------------------- the RL forward with TRL's statistics

@opaque_op("fusedce_lm::chunked_token_stats", mutates_args=(), observable=True)
def _stats_op(hidden: Tensor, weight: Tensor, bias: Opt, target: Tensor, ignore_index: int, scalars: list[float],
              backend: str, chunk_size: int, logits: str, entropy: bool
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    ce = chunk_ce(backend, hidden.device)
    opts = LossOptions.from_op_args(ignore_index, scalars)
    rows = rows_of(chunk_size, hidden, weight)
    n = hidden.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse, lse_lo = torch.empty_like(loss), torch.empty_like(loss)
    ent = torch.empty_like(loss) if entropy else _empty(hidden)
    stats = (torch.empty_like(loss), torch.empty_like(loss), torch.empty(n, dtype=torch.bool, device=hidden.device))
    buffer = loop.chunk_buffer(n, rows, weight, hidden.dtype, logits)
    kind = logits   # the name ``logits`` is the chunk's tensor below
    for s in range(0, n, rows):
        c = slice(s, s + rows)
        logits = loop.logits_chunk(hidden[c], weight, bias, buffer, kind)
        out = ce.loss(logits, target[c], None, None, opts, False, entropy)
        loss[c], lse[c], lse_lo[c] = out[:3]
        if entropy:
            ent[c] = out[4]
        for dst, value in zip(stats, ce.token_stats(logits, target[c], lse[c], lse_lo[c], opts)):
            dst[c] = value
        del logits
    return loss, lse, lse_lo, ent, *stats


@_stats_op.register_fake
def _(hidden, weight, bias, target, ignore_index, scalars, backend, chunk_size, logits, entropy):
    n = hidden.shape[0]
    return (f32(hidden, n), f32(hidden, n), f32(hidden, n), f32(hidden, n if entropy else 0), f32(hidden, n),
            f32(hidden, n), hidden.new_empty(n, dtype=torch.bool))


def loss_with_token_stats(ce, chunk_size: Optional[int], hidden, weight, bias, target, opts: LossOptions,
                          want_entropy: bool, logits: str = "float32"):
    """The chunked forward with TRL's statistics, per chunk the logits once, then ``ce.loss`` and
    ``ce.token_stats`` on them: ``(loss, lse, lse_lo, entropy or None, (log_sum_sq_probs, mean_logits,
    is_top1))``."""
    loss, lse, lse_lo, ent, *stats = _stats_op(hidden, weight, bias, target, *opts.op_args(), ce.NAME,
                                               chunk_size or 0, logits, want_entropy)
    return loss, lse, lse_lo, ent if want_entropy else None, tuple(stats)
