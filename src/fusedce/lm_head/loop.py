"""The chunk loop of the LM head (logits of ``rows`` tokens at a time, never BT x V), its rows rule and its
class-index kinds (``kinds.py``). Design and measurements: ``docs/lm_head.md``."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.bf16_products import exact_bf16_gemms, upcast_gemms
from fusedce.core.options import LossOptions
from fusedce.core.row_math import grad_lse, target_probability
from fusedce.core.validation import host_readable
from . import kinds
from .fp32_linear import grad_hidden_fp32_, linear_fp32_
from .kinds import Args, loss_args, register

Opt = Optional[torch.Tensor]
LOW = (torch.bfloat16, torch.float16)   # the dtypes whose CPU GEMM may be torch's scalar fallback
Tensor = torch.Tensor


# ---------------------------------------------------------------- the rows rule (chunk_size=None)

MIN_ROWS = 1024
CPU_MIN_ROWS = 64
CPU_H_FRACTION = 4


def chunk_rows(n_rows: int, hidden_size: int, vocab_size: int, device_type: str = "cuda") -> int:
    """Rows per chunk for ``chunk_size=None`` on a ``device_type`` device: in ``[1, n_rows]``."""
    if device_type == "cpu" and not torch.compiler.is_compiling():
        rows = max(CPU_MIN_ROWS, -(-hidden_size // CPU_H_FRACTION))
    else:
        rows = max(MIN_ROWS, -(-n_rows * hidden_size // max(vocab_size, 1)))
    return max(1, min(n_rows, rows))


# ---------------------------------------------------------------- the loop

_OUT_DTYPE_MM: dict = {}   # device type -> bool; filled only by eager calls on real tensors


def logits_dtype(operand_dtype: torch.dtype, logits: str = "float32") -> torch.dtype:
    """The chunk logits' dtype: fp32 (``logits="float32"``) or the operands' own (``"input"``: stock's rounding)."""
    return operand_dtype if logits == "input" else torch.float32


def logits_chunk(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 buffer: Optional[torch.Tensor] = None, logits: str = "float32") -> torch.Tensor:
    """``h @ weight.T (+ bias)`` in ``logits_dtype(h.dtype, logits)``, into ``buffer[:n]`` when given (then its
    dtype decides); fp32 logits of 16-bit operands by ``fp32_linear.linear_fp32_``."""
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
    """One ``rows x V`` logits buffer for the whole loop, or None under torch.compile / CUDA-graph capture
    (each chunk then gets its own tensor)."""
    if not host_readable(weight):
        return None
    return torch.empty(min(rows, n_rows), weight.shape[0], dtype=logits_dtype(dtype, logits),
                       device=weight.device)


def _mm_out_dtype_ok(acc: torch.Tensor) -> bool:
    """Whether ``torch.addmm`` / ``torch.mm`` with ``out_dtype=`` may write into ``acc`` (probed once per device
    type in eager; False while tracing, capturing or on non-plain tensors)."""
    if not host_readable(acc) or type(acc) is not torch.Tensor:
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
    """``acc += g.T @ h`` in ``acc``'s dtype, no V x H temporary; ``scratch`` (``g``'s shape, ``acc``'s dtype,
    overwritable) takes ``g``'s upcast where one is needed (``upcast_ready``: it holds it already)."""
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
    """``(grad_hidden, grad_weight, grad_bias)`` (None where ``needs`` says no): the first uninitialized in
    hidden's dtype, the other two zeros in ``accum_dtype``."""
    grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if needs[0] else None
    grad_w = torch.zeros(weight.shape, dtype=accum_dtype, device=weight.device) if needs[1] else None
    grad_b = torch.zeros(weight.shape[0], dtype=accum_dtype, device=weight.device) if needs[2] else None
    return grad_h, grad_w, grad_b


def backprop_chunk_(g: torch.Tensor, h_c: torch.Tensor, weight: torch.Tensor, rows: slice, grad_h, grad_w,
                    grad_b) -> None:
    """``grad_h[rows] = g @ W``, ``grad_W += g.T @ h_c``, ``grad_b += sum_rows g`` (each skipped when None) for
    one chunk's logits gradient ``g``; an fp32 ``g`` of 16-bit operands is rounded to their dtype once, as
    stock's backward, and ``g`` itself is overwritten (``accumulate_``'s scratch)."""
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
    """The LM head's backward over chunks of ``rows`` tokens, each chunk's logits gradient from
    ``grad_of_chunk(rows_slice, logits_c)`` (it may overwrite and return ``logits_c``): ``grad_buffers``' three."""
    n = hidden.shape[0]
    grad_h, grad_w, grad_b = grad_buffers(hidden, weight, needs, accum_dtype)
    buffer = chunk_buffer(n, rows, weight, hidden.dtype, logits)
    for s in range(0, n, rows):
        c = slice(s, s + rows)
        h_c = hidden[c]
        g = grad_of_chunk(c, logits_chunk(h_c, weight, bias, buffer, logits))
        backprop_chunk_(g, h_c, weight, c, grad_h, grad_w, grad_b)
        del g   # without a buffer: this chunk freed before the next is allocated
    return grad_h, grad_w, grad_b


def loss_loop(ce, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, rows: int, stats: bool,
              entropy: bool = False, logits: str = "float32", token_stats: bool = False):
    """Per-row ``(loss, lse, lse_lo, predicted, token_weight, entropy, token_stats)`` for every token
    (cross-entropy without z-loss, fp32; predicted int64, -1 where not computed; ``token_weight`` the detached
    ``p_t`` with ``use_token_scaling``, else None; ``entropy`` fp32 when asked, else None; ``token_stats`` TRL's
    ``(log_sum_sq_probs, mean_logits, is_top1)`` from ``ce.token_stats`` when asked, else ()); no gradient
    buffers at all."""
    n = hidden.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse, lse_lo = torch.empty_like(loss), torch.empty_like(loss)
    ent = torch.empty_like(loss) if entropy else None
    predicted = torch.full((n,), -1, dtype=torch.int64, device=hidden.device)
    token_weight = torch.empty_like(loss) if opts.use_token_scaling else None
    more = (torch.empty_like(loss), torch.empty_like(loss), loss.new_empty(n, dtype=torch.bool)) if token_stats else ()
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
        for dst, value in zip(more, ce.token_stats(logits, target[c], lse[c], lse_lo[c], opts) if more else ()):
            dst[c] = value
        del logits
    return loss, lse, lse_lo, predicted, token_weight, ent, more


def grads_loop(ce, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, rows: int, grad_row, z_grad_row,
          needs, accum_dtype, saved=None, stats: bool = False, grad_entropy=None, logits: str = "float32"):
    """Gradients of ``sum_i grad_row[i] ce_i + z_grad_row[i] z_i (+ grad_entropy[i] entropy_i)`` (with token
    scaling both upstreams times ``p_t``) and, when ``saved = (lse, lse_lo, token_weight, entropy)`` is None, the
    forward too. Returns ``(loss, lse, lse_lo, predicted, token_weight, grad_hidden, grad_weight, grad_bias)``
    (loss / predicted None with ``saved``; the last two in ``accum_dtype``)."""
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


# ---------------------------------------------------------------- the loops as kinds (``kinds.py``)

def chunk_ce(backend: str):
    """The ``ChunkCE`` of the backend named ``backend`` (resolved and checked by the caller)."""
    from fusedce import backends
    return backends.named(backend).CHUNK_CE


def rows_of(chunk_size: int, hidden: Tensor, weight: Tensor) -> int:
    """``chunk_size``, or the rule's rows (``loop.chunk_rows``) for 0 / None."""
    return chunk_size or chunk_rows(hidden.shape[0], hidden.shape[1], weight.shape[0], hidden.device.type)


def or_empty(t: Opt, like: Tensor, dtype=torch.float32) -> Tensor:
    """``t``, or a (0,) tensor of ``dtype`` for an output a loop op does not make (ops return tensors)."""
    return like.new_empty(0, dtype=dtype) if t is None else t


def f32(like: Tensor, *shape) -> Tensor:
    """An uninitialized fp32 tensor of ``shape`` on ``like``'s device (the per-row outputs and their fakes)."""
    return like.new_empty(shape, dtype=torch.float32)


def grads_fake(hidden: Tensor, weight: Tensor, needs, accum_dtype: torch.dtype) -> list:
    """The fakes of ``(grad_hidden, grad_weight, grad_bias)`` ((0,) where ``needs`` says no)."""
    return [hidden.new_empty(hidden.shape if needs[0] else (0,)),
            weight.new_empty(weight.shape if needs[1] else (0,), dtype=accum_dtype),
            weight.new_empty(weight.shape[0] if needs[2] else 0, dtype=accum_dtype)]


@register("ce")
class _CE:
    """Class-index cross-entropy. Tensors ``hidden, weight, bias, target, w, weight_sum`` (the backward's then
    ``grad_row, z_grad_row, lse, lse_lo, token_weight, grad_entropy, entropy``: ``lse`` None to run the
    forward too); ints ``ignore_index, chunk_size, stats, entropy`` (backward: ``..., stats, needs x3``);
    words ``backend,logits``; the backward's dtype the accumulation's."""

    @staticmethod
    def forward(a: Args) -> list:
        hidden, weight, bias, target, w, weight_sum = a.t
        loss, lse, lse_lo, predicted, token_weight, ent, _ = loss_loop(
            chunk_ce(a.word(0)), hidden, weight, bias, target, w, weight_sum, a.opts(),
            rows_of(a.i[1], hidden, weight), bool(a.i[2]), bool(a.i[3]), a.word(1))
        return [loss, lse, lse_lo, predicted, or_empty(token_weight, hidden), or_empty(ent, hidden)]

    @staticmethod
    def forward_fake(a: Args) -> list:
        hidden, n = a.t[0], a.t[0].shape[0]
        return [f32(hidden, n), f32(hidden, n), f32(hidden, n), hidden.new_empty(n, dtype=torch.int64),
                f32(hidden, n if a.opts().use_token_scaling else 0), f32(hidden, n if a.i[3] else 0)]

    @staticmethod
    def backward(a: Args) -> list:
        hidden, weight, bias, target, w, weight_sum, grad_row, z_grad_row, lse, lse_lo, token_weight, g_ent, ent = a.t
        saved = None if lse is None else (lse, lse_lo, token_weight, ent)
        out = grads_loop(chunk_ce(a.word(0)), hidden, weight, bias, target, w, weight_sum, a.opts(),
                         rows_of(a.i[1], hidden, weight), grad_row, z_grad_row, tuple(map(bool, a.i[3:6])), a.dtype,
                         saved=saved, stats=bool(a.i[2]), grad_entropy=g_ent, logits=a.word(1))
        loss, lse_out, lse_lo_out, predicted, tw, g_h, g_w, g_b = out
        if saved is not None:   # never return an input (a custom op may not alias one): the entry point has them
            lse_out = lse_lo_out = None
            if token_weight is not None:
                tw = None
        return [or_empty(loss, hidden), or_empty(lse_out, hidden), or_empty(lse_lo_out, hidden),
                or_empty(predicted, hidden, torch.int64), or_empty(tw, hidden), or_empty(g_h, hidden, hidden.dtype),
                or_empty(g_w, hidden, a.dtype), or_empty(g_b, hidden, a.dtype)]

    @staticmethod
    def backward_fake(a: Args) -> list:
        hidden, weight, n, token_weight = a.t[0], a.t[1], a.t[0].shape[0], a.t[10]
        forward = a.t[8] is None
        k = n if forward else 0
        scaling = a.opts().use_token_scaling
        return [f32(hidden, k), f32(hidden, k), f32(hidden, k), hidden.new_empty(k, dtype=torch.int64),
                f32(hidden, n if scaling and (forward or token_weight is None) else 0),
                *grads_fake(hidden, weight, a.i[3:6], a.dtype)]


def _words(ce, logits: str) -> str:
    return f"{ce.NAME},{logits}"


def loss_only(ce, chunk_size: Optional[int], hidden, weight, bias, target, w, weight_sum, opts: LossOptions,
              stats: bool, entropy: bool = False, logits: str = "float32"):
    """``loss_loop`` as one op (``chunk_size`` None: the rule's rows)."""
    loss, lse, lse_lo, predicted, token_weight, ent = kinds.forward(
        "ce", [hidden, weight, bias, target, w, weight_sum], *loss_args(opts, chunk_size or 0, stats, entropy),
        _words(ce, logits))
    return (loss, lse, lse_lo, predicted, token_weight if opts.use_token_scaling else None,
            ent if entropy else None)


def grads(ce, chunk_size: Optional[int], hidden, weight, bias, target, w, weight_sum, opts: LossOptions, grad_row,
          z_grad_row, needs, accum_dtype, saved=None, stats: bool = False, grad_entropy=None,
          logits: str = "float32"):
    """``grads_loop`` as one op (same arguments and results; ``chunk_size`` None: the rule's rows)."""
    lse, lse_lo, token_weight, entropy = (None,) * 4 if saved is None else saved
    loss, lse_out, lse_lo_out, predicted, tw, g_h, g_w, g_b = kinds.backward(
        "ce", [hidden, weight, bias, target, w, weight_sum, grad_row, z_grad_row, lse, lse_lo, token_weight,
               grad_entropy, None if grad_entropy is None else entropy],
        *loss_args(opts, chunk_size or 0, stats, *needs), _words(ce, logits), accum_dtype)
    if saved is not None:
        loss = predicted = None
        lse_out, lse_lo_out = lse, lse_lo
        if token_weight is not None:
            tw = token_weight
    if not opts.use_token_scaling:
        tw = None
    return (loss, lse_out, lse_lo_out, predicted, tw, g_h if needs[0] else None, g_w if needs[1] else None,
            g_b if needs[2] else None)


@register("ce_stats")
class _TokenStats:
    """The RL forward with TRL's statistics (``loss_loop``'s ``token_stats``): tensors ``hidden, weight, bias,
    target``; ints ``ignore_index, chunk_size, entropy``; words ``backend,logits``."""

    @staticmethod
    def forward(a: Args) -> list:
        hidden, weight, bias, target = a.t
        loss, lse, lse_lo, _, _, ent, stats = loss_loop(
            chunk_ce(a.word(0)), hidden, weight, bias, target, None, None, a.opts(), rows_of(a.i[1], hidden, weight),
            False, bool(a.i[2]), a.word(1), token_stats=True)
        return [loss, lse, lse_lo, or_empty(ent, hidden), *stats]

    @staticmethod
    def forward_fake(a: Args) -> list:
        hidden, n = a.t[0], a.t[0].shape[0]
        return [f32(hidden, n), f32(hidden, n), f32(hidden, n), f32(hidden, n if a.i[2] else 0), f32(hidden, n),
                f32(hidden, n), hidden.new_empty(n, dtype=torch.bool)]


def loss_with_token_stats(ce, chunk_size: Optional[int], hidden, weight, bias, target, opts: LossOptions,
                          want_entropy: bool, logits: str = "float32"):
    """The chunked forward with TRL's statistics: ``(loss, lse, lse_lo, entropy or None, (log_sum_sq_probs,
    mean_logits, is_top1))``."""
    loss, lse, lse_lo, ent, *stats = kinds.forward("ce_stats", [hidden, weight, bias, target],
                                                   *loss_args(opts, chunk_size or 0, want_entropy),
                                                   _words(ce, logits))
    return loss, lse, lse_lo, ent if want_entropy else None, tuple(stats)
