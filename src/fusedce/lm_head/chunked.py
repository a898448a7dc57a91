"""The chunk loop: logits of ``rows`` tokens at a time, never BT x V.

Per chunk c (hidden rows h_c, n_c x H):
    logits_c = h_c @ W.T (+ b)                       n_c x V fp32 from the operands' values (``fp32_linear``;
                                                     ``logits="input"``: hidden's dtype, as F.linear),
                                                     written into one chunk buffer reused by every chunk
    loss_c, lse_c, g_c = dloss/dlogits_c              one backend call, ``ChunkCE.loss_and_grad_``: the
                                                     gradient written over logits_c (Triton: one fused
                                                     kernel, the chunk read once and written once)
    grad_h_c = g_c @ W;  grad_W += g_c.T @ h_c;  grad_b += sum_rows g_c   (accum_dtype accumulators)
FLOPs: 2 n_c V H for the logits and 2 n_c V H for each of grad_h and grad_W, as the unfused path.
Launches per chunk (Triton, mean / sum): 1 matmul + 1 cross-entropy kernel + the gradient matmuls.

``grad_W += g_c.T @ h_c`` with a ``grad_W`` wider than the chunk (fp32 accumulator, bf16/fp16 chunk):
eager calls use ``torch.addmm(..., out_dtype=fp32, out=grad_W)`` where the build has it (CUDA; a one-time
probe per device type, cached for the process), so no fp32 copy of the chunk is made; elsewhere (CPU
kernels) the chunk operands are upcast to fp32 (n_c x V and n_c x H, never V x H; the fp32 logits' own
chunk buffer serves as the upcast gradient, ``backprop_chunk_``), and on a CPU with bf16 units that GEMM of
bf16 values runs on them (``core/bf16_products.py``: exact, fp32 accumulation). Traced or captured
code (``torch.compile`` / ``torch.export``, CUDA-graph capture, fake tensors) always takes the upcast path
and never probes nor fills the cache: Inductor cannot lower an ``out_dtype`` addmm, fake tensors would
accept it on any device, and a graph must not depend on which call came first. So on CUDA,
``addmm(out_dtype)`` runs only in eager; compiled graphs and captured CUDA graphs use the upcast path
(the same fp32 sums of exact products; only the summation order may differ).
"""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.bf16_products import exact_bf16_gemms, upcast_gemms
from fusedce.core.options import LossOptions
from fusedce.core.row_math import grad_lse, target_probability
from fusedce.core.validation import sync_allowed
from .fp32_linear import grad_hidden_fp32_, linear_fp32_

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
    if upcast_gemms(h, weight):   # the operands' rounding from an fp32 GEMM: torch's own is the scalar fallback
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


def accumulate_(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> None:
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
        g32 = scratch.copy_(g).t() if reuse else g.t().to(acc.dtype)   # the same values and layout either way
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
    if grad_h is not None and upcast_gemms(g, weight):   # torch's low-precision GEMM: the scalar fallback
        g32 = scratch.copy_(g) if scratch is not None else g.float()
        grad_hidden_fp32_(g32, weight, grad_h[rows])
    elif grad_h is not None:
        torch.mm(g, weight, out=grad_h[rows])
    if grad_w is not None:
        accumulate_(grad_w, g, h_c, scratch)
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


def loss_only(ce, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, rows: int, stats: bool,
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


def grads(ce, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, rows: int, grad_row, z_grad_row,
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
