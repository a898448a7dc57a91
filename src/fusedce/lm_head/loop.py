"""The chunk loop of the LM head (logits of ``rows`` tokens at a time, never BT x V), its rows rule and its
custom ops for torch.compile (one node per loop, one compilation for every token count). The design, the
rule's measurements and the ops' contracts: ``docs/lm_head.md``."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.bf16_products import exact_bf16_gemms, upcast_gemms
from fusedce.core.opaque import opaque_op
from fusedce.core.options import LossOptions
from fusedce.core.row_math import grad_lse, target_probability
from fusedce.core.validation import sync_allowed
from .fp32_linear import grad_hidden_fp32_, linear_fp32_

Opt = Optional[torch.Tensor]
LOW = (torch.bfloat16, torch.float16)   # the dtypes whose CPU GEMM may be torch's scalar fallback
Tensor = torch.Tensor


# ---------------------------------------------------------------- the rows rule (chunk_size=None)

MIN_ROWS = 1024
CPU_MIN_ROWS = 64
CPU_H_FRACTION = 4


def chunk_rows(n_rows: int, hidden_size: int, vocab_size: int, device_type: str = "cuda") -> int:
    """Rows per chunk for ``chunk_size=None`` on a ``device_type`` device ("cpu", "cuda", ...): at least 1,
    at most ``n_rows`` (the rule in the module docstring)."""
    if device_type == "cpu" and not torch.compiler.is_compiling():
        rows = max(CPU_MIN_ROWS, -(-hidden_size // CPU_H_FRACTION))
    else:
        rows = max(MIN_ROWS, -(-n_rows * hidden_size // max(vocab_size, 1)))
    return max(1, min(n_rows, rows))


# ---------------------------------------------------------------- the loop

_OUT_DTYPE_MM: dict = {}   # device type -> bool; filled only by eager calls on real tensors


def logits_dtype(operand_dtype: torch.dtype, logits: str = "float32") -> torch.dtype:
    """The dtype of the chunk logits: fp32 (``logits="float32"``, the default: the exact products of the
    operands summed in fp32, ``fp32_linear.py``) or the operands' own (``logits="input"``: the stock
    composition's ``F.linear`` rounding, for exact parity with it)."""
    return operand_dtype if logits == "input" else torch.float32


def logits_chunk(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 buffer: Optional[torch.Tensor] = None, logits: str = "float32") -> torch.Tensor:
    """``h @ weight.T (+ bias)`` in ``logits_dtype(h.dtype, logits)``, written into ``buffer[:n]`` when one
    is given (then its dtype decides). Operands of that dtype: the ``addmm`` / ``mm`` that ``F.linear``
    runs, so the same values; fp32 logits of bf16 / fp16 operands: ``fp32_linear.linear_fp32_`` (no fp32
    copy of the weight)."""
    dtype = logits_dtype(h.dtype, logits) if buffer is None else buffer.dtype
    if dtype != h.dtype:
        out = buffer[: h.shape[0]] if buffer is not None else torch.empty(
            h.shape[0], weight.shape[0], dtype=dtype, device=h.device)
        return linear_fp32_(h, weight, bias, out, _mm_out_dtype_ok(out))
    if h.dtype in LOW and upcast_gemms(h, weight):   # torch's own GEMM is the scalar fallback
        out32 = linear_fp32_(h, weight, bias, torch.empty(h.shape[0], weight.shape[0], device=h.device), False)
        return out32.to(dtype) if buffer is None else buffer[: h.shape[0]].copy_(out32)
    if buffer is None:
        return torch.nn.functional.linear(h, weight, bias)
    out = buffer[: h.shape[0]]
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)


def chunk_buffer(n_rows: int, rows: int, weight: torch.Tensor, dtype: torch.dtype,
                 logits: str = "float32") -> Optional[torch.Tensor]:
    """One ``rows x V`` logits buffer for the whole loop, in ``logits_dtype(dtype, logits)`` (``dtype``:
    the operands'), or None under torch.compile / CUDA-graph capture, where each chunk gets its own
    tensor: ``out=`` into a reused buffer is an eager-only allocation saving)."""
    if not sync_allowed(weight):
        return None
    return torch.empty(min(rows, n_rows), weight.shape[0], dtype=logits_dtype(dtype, logits),
                       device=weight.device)


def _mm_out_dtype_ok(acc: torch.Tensor) -> bool:
    """Whether ``torch.addmm(..., out_dtype=)`` / ``torch.mm(..., out_dtype=)`` may write into ``acc``
    (eager CUDA builds; not the CPU kernels). False, without probing or caching, while tracing (torch.compile /
    export), capturing a CUDA graph or on non-plain tensors (fake / functional / subclass): see the module
    docstring."""
    if not sync_allowed(acc) or type(acc) is not torch.Tensor:
        return False
    key = acc.device.type
    if key not in _OUT_DTYPE_MM:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=acc.device)
        if type(a) is not torch.Tensor:   # a fake / proxy mode is active: not the real kernels
            return False
        try:
            out = torch.zeros(2, 2, dtype=torch.float32, device=a.device)
            torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
            torch.mm(a, a, out_dtype=torch.float32, out=out)   # the fp32 logits' GEMM (fp32_linear.py)
            _OUT_DTYPE_MM[key] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE_MM[key] = False
    return _OUT_DTYPE_MM[key]


def accumulate_(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor, scratch: Optional[torch.Tensor] = None,
                upcast_ready: bool = False) -> None:
    """``acc += g.T @ h`` with ``acc`` in its own (accumulation) dtype, no fresh V x H temporary (``g``
    may be fp32 logits' gradient with a bf16 / fp16 ``h``). ``scratch``: an optional tensor of ``g``'s
    shape in ``acc``'s dtype that may be overwritten (the fp32 chunk ``g`` was rounded from): the upcast of
    ``g``, where one is needed, is written there instead of into a fresh chunk-sized buffer."""
    if acc.dtype == g.dtype == h.dtype:
        acc.addmm_(g.t(), h)
    elif g.dtype == h.dtype and _mm_out_dtype_ok(acc):
        torch.addmm(acc, g.t(), h, out_dtype=acc.dtype, out=acc)
    else:  # upcast the chunk operands (n_c x V and n_c x H), never the V x H result
        reuse = scratch is not None and scratch.shape == g.shape and scratch.dtype == acc.dtype
        g32 = (scratch if upcast_ready else scratch.copy_(g)).t() if reuse else g.t().to(acc.dtype)   # the same values and layout either way
        h32 = h.to(acc.dtype)
        with exact_bf16_gemms(g, h):   # both bf16: the CPU's bf16 units, the same exact products
            acc.addmm_(g32, h32)


def grad_buffers(hidden: torch.Tensor, weight: torch.Tensor, needs, accum_dtype: torch.dtype) -> tuple:
    """``(grad_hidden, grad_weight, grad_bias)`` buffers of the chunk loops (None where ``needs`` says
    no): grad_hidden uninitialized in hidden's dtype (every chunk writes its rows), the other two zeros
    in ``accum_dtype`` (every chunk adds to them)."""
    grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if needs[0] else None
    grad_w = torch.zeros(weight.shape, dtype=accum_dtype, device=weight.device) if needs[1] else None
    grad_b = torch.zeros(weight.shape[0], dtype=accum_dtype, device=weight.device) if needs[2] else None
    return grad_h, grad_w, grad_b


def backprop_chunk_(g: torch.Tensor, h_c: torch.Tensor, weight: torch.Tensor, rows: slice, grad_h, grad_w,
                    grad_b) -> None:
    """Through the LM head, for one chunk whose logits' gradient is ``g`` (n_c x V, the logits' dtype):
    ``grad_h[rows] = g @ W``, ``grad_W += g.T @ h_c``, ``grad_b += sum_rows g`` (each skipped when None;
    the last two in their own accumulation dtype). An fp32 ``g`` of bf16 / fp16 operands (the fp32
    logits' gradient) is rounded to the operands' dtype once (a chunk-sized copy), as the stock
    composition's low-precision backward has it, so both GEMMs stay the fast low-precision ones; ``g``
    is then free, and where the weight-gradient GEMM needs an fp32 upcast of the rounded values (CPU) they
    are written into ``g`` itself (``accumulate_``'s ``scratch``: ``g`` is overwritten)."""
    scratch = None
    if g.dtype != weight.dtype:
        scratch, g = g, g.to(weight.dtype)
    ready = False   # scratch holds g's upcast values (written once for both GEMMs)
    if grad_h is not None and g.dtype in LOW and upcast_gemms(g, weight):   # torch's GEMM: the scalar fallback
        g32 = scratch.copy_(g) if scratch is not None else g.float()
        ready = scratch is not None
        grad_hidden_fp32_(g32, weight, grad_h[rows])
    elif grad_h is not None:
        torch.mm(g, weight, out=grad_h[rows])
    if grad_w is not None:
        accumulate_(grad_w, g, h_c, scratch, upcast_ready=ready)
    if grad_b is not None:
        grad_b += g.sum(dim=0, dtype=grad_b.dtype)


def backprop_chunks(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], rows: int, needs,
                    accum_dtype: torch.dtype, grad_of_chunk, logits: str = "float32") -> tuple:
    """The backward of the LM head over chunks of ``rows`` tokens when each chunk's logits gradient comes
    from ``grad_of_chunk(rows_slice, logits_c) -> g_c`` (n_c x V, the logits' dtype; it may overwrite and
    return ``logits_c``): logits recomputed into one reused buffer, then ``backprop_chunk_``. Returns
    ``grad_buffers``' three tensors (the vocab-parallel ops run their slice gradient through it)."""
    n = hidden.shape[0]
    grad_h, grad_w, grad_b = grad_buffers(hidden, weight, needs, accum_dtype)
    buffer = chunk_buffer(n, rows, weight, hidden.dtype, logits)
    for s in range(0, n, rows):
        c = slice(s, s + rows)
        h_c = hidden[c]
        g = grad_of_chunk(c, logits_chunk(h_c, weight, bias, buffer, logits))
        backprop_chunk_(g, h_c, weight, c, grad_h, grad_w, grad_b)
    return grad_h, grad_w, grad_b


def loss_loop(ce, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, rows: int, stats: bool,
              entropy: bool = False, logits: str = "float32"):
    """Per-row ``(loss, lse, lse_lo, predicted, token_weight, entropy)`` for every token (cross-entropy
    without z-loss, fp32; predicted int64, -1 where not computed; ``token_weight`` the detached ``p_t``
    with ``use_token_scaling``, else None; ``entropy`` fp32 when asked, else None); no gradient
    buffers at all."""
    n = hidden.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse, lse_lo = torch.empty_like(loss), torch.empty_like(loss)
    ent = torch.empty_like(loss) if entropy else None
    predicted = torch.full((n,), -1, dtype=torch.int64, device=hidden.device)
    token_weight = torch.empty_like(loss) if opts.use_token_scaling else None
    kind = logits   # the name ``logits`` is the chunk's tensor below
    buffer = chunk_buffer(n, rows, weight, hidden.dtype, kind)
    for s in range(0, n, rows):
        c = slice(s, s + rows)
        logits = logits_chunk(hidden[c], weight, bias, buffer, kind)
        out = ce.loss(logits, target[c], w, weight_sum, opts, stats, entropy)
        loss[c], lse[c], lse_lo[c] = out[:3]
        if stats:
            predicted[c] = out[3]
        if entropy:
            ent[c] = out[4]
        if token_weight is not None:
            token_weight[c] = target_probability(logits, target[c], lse[c], lse_lo[c], opts)
    return loss, lse, lse_lo, predicted, token_weight, ent


def grads_loop(ce, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, rows: int, grad_row, z_grad_row,
          needs, accum_dtype, saved=None, stats: bool = False, grad_entropy=None, logits: str = "float32"):
    """Gradients of ``sum_i grad_row[i] ce_i + z_grad_row[i] z_i (+ grad_entropy[i] entropy_i)``
    (``ce_i`` the cross-entropy of row i, ``z_i = s lse_i**2`` its z-loss) and, when ``saved`` is None,
    the forward too.

    ``grad_row``, ``z_grad_row``: (n,) per-row upstream gradients (any strides); with
    ``use_token_scaling`` both are multiplied by each row's ``p_t`` (read from the chunk's logits
    before they are overwritten, or the saved one). ``needs``: which of (hidden, weight, bias) need a
    gradient. ``saved = (lse, lse_lo, token_weight, entropy)`` from an earlier forward (token_weight /
    entropy None when not made): the forward is not recomputed (a backward that recomputes; the only
    form that takes ``grad_entropy``). ``logits``: ``"float32"`` or ``"input"`` (``logits_dtype``).
    Returns ``(loss, lse, lse_lo, predicted, token_weight, grad_hidden, grad_weight, grad_bias)``;
    loss/predicted are None when ``saved`` was given;
    token_weight None without token scaling; grad_weight / grad_bias are in ``accum_dtype``.
    """
    n = hidden.shape[0]
    forward = saved is None
    if forward:
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse, lse_lo = torch.empty_like(loss), torch.empty_like(loss)
        predicted = torch.full((n,), -1, dtype=torch.int64, device=hidden.device)
    else:
        loss = predicted = None
        lse, lse_lo, saved_weight, entropy = saved
    token_weight = torch.empty(n, dtype=torch.float32, device=hidden.device) if opts.use_token_scaling else None
    if not forward and token_weight is not None and saved_weight is not None:
        token_weight = saved_weight
    grad_h, grad_w, grad_b = grad_buffers(hidden, weight, needs, accum_dtype)
    kind = logits   # the name ``logits`` is the chunk's tensor below
    buffer = chunk_buffer(n, rows, weight, hidden.dtype, kind)
    for s in range(0, n, rows):
        c = slice(s, s + rows)
        h_c = hidden[c]
        logits = logits_chunk(h_c, weight, bias, buffer, kind)
        if forward:
            loss[c], lse[c], lse_lo[c], pred_c, tw_c = ce.loss_and_grad_(
                logits, target[c], w, weight_sum, grad_row[c], z_grad_row[c], opts, stats)
            if stats:
                predicted[c] = pred_c
            if token_weight is not None:
                token_weight[c] = tw_c
        else:
            g_c, zg_c = grad_row[c], z_grad_row[c]
            if token_weight is not None:
                if saved_weight is None:
                    token_weight[c] = target_probability(logits, target[c], lse[c], lse_lo[c], opts)
                g_c, zg_c = g_c * token_weight[c], zg_c * token_weight[c]
            ce.grad_(logits, target[c], w, weight_sum, lse[c], lse_lo[c], g_c, grad_lse(lse[c], zg_c, opts), opts,
                     grad_entropy=None if grad_entropy is None else grad_entropy[c],
                     entropy=None if grad_entropy is None else entropy[c])
        backprop_chunk_(logits, h_c, weight, c, grad_h, grad_w, grad_b)
        del logits   # without a buffer: free this chunk before the next is allocated (one alive, not two)
    return loss, lse, lse_lo, predicted, token_weight, grad_h, grad_w, grad_b


# ---------------------------------------------------------------- the loop as custom ops

def chunk_ce(backend: str, device: torch.device):
    """The ``ChunkCE`` of the backend named ``backend`` (resolved and checked by the caller)."""
    from fusedce import backends
    return backends.named(backend).CHUNK_CE


def rows_of(chunk_size: int, hidden: Tensor, weight: Tensor) -> int:
    """``chunk_size``, or the rule's rows (``loop.chunk_rows``) for 0 / None."""
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
    loss, lse, lse_lo, predicted, token_weight, ent = loss_loop(
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
    """``loss_loop`` as one op (``chunk_size`` None: the rule's rows)."""
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
    out = grads_loop(chunk_ce(backend, hidden.device), hidden, weight, bias, target, w, weight_sum, opts,
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
    """``grads_loop`` as one op (same arguments and results; ``chunk_size`` None: the rule's rows)."""
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
    buffer = chunk_buffer(n, rows, weight, hidden.dtype, logits)
    kind = logits   # the name ``logits`` is the chunk's tensor below
    for s in range(0, n, rows):
        c = slice(s, s + rows)
        logits = logits_chunk(hidden[c], weight, bias, buffer, kind)
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
