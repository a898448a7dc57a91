"""The LM head's method (``METHODS``, ``check_method``, ``resolve_method``, ``make_head``), its two heads
(``ChunkedHead``: the chunk loop, ``loop.py``; ``TiledHead``: the backend's ``TiledCE``), the fp16 headroom of
forward-made gradients and the compaction of ignored rows, shared by the linear families. Details:
``docs/lm_head.md``."""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.core.options import LossOptions
from fusedce.core.reduction import MeanScales, reduce, times, token_scaled, z_rows
from fusedce.core.row_math import grad_lse
from fusedce.core.validation import host_readable
from . import invariant, loop
from ..backends.protocol import ChunkCE, TiledCE


class _ClassRows:
    """``LinearHeadFunction``'s interface of the class-index heads: the per-row factor is ``p_t``
    (``use_token_scaling``), no per-row state."""

    def rows_forward(self, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, stats: bool):
        return self.forward(hidden, weight, bias, target, w, weight_sum, opts, stats)[:5] + (None,)

    def rows_grads(self, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, grad_row, z_grad_row,
                   needs, accum_dtype, saved=None, stats: bool = False):
        out = self.grads(hidden, weight, bias, target, w, weight_sum, opts, grad_row, z_grad_row, needs, accum_dtype,
                         saved=saved, stats=stats)
        return out[:5] + (None,) + out[5:]


class ChunkedHead(_ClassRows):
    """``chunk_size``: rows per chunk, None for the rule (``loop.chunk_rows``, decided from the real
    token count inside the loop's op, ``loop.py``: a traced call does not specialize on it)."""
    grads_in_forward = True

    def __init__(self, ce: ChunkCE, chunk_size, logits: str = "float32"):
        self.ce, self.chunk_size, self.logits = ce, chunk_size, logits   # logits: chunked.logits_dtype's choice

    def invariant_rows(self, n_classes: int) -> int:
        """``batch_invariant``'s row multiple: the fixed chunk (``invariant.ROWS``; ``chunk_size`` is then it)."""
        return invariant.ROWS

    def rows_for(self, hidden, weight) -> int:
        """The rows per chunk for these operands (for loops that run outside ``loop_ops``)."""
        return loop.rows_of(self.chunk_size, hidden, weight)

    def forward(self, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, stats: bool,
                entropy: bool = False):
        return loop.loss_only(self.ce, self.chunk_size, hidden, weight, bias, target, w, weight_sum, opts,
                              stats, entropy, self.logits)

    def grads(self, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, grad_row, z_grad_row, needs,
              accum_dtype, saved=None, stats: bool = False, grad_entropy=None):
        return loop.grads(self.ce, self.chunk_size, hidden, weight, bias, target, w, weight_sum, opts,
                          grad_row, z_grad_row, needs, accum_dtype, saved=saved, stats=stats,
                          grad_entropy=grad_entropy, logits=self.logits)


class TiledHead(_ClassRows):
    grads_in_forward = False

    def __init__(self, tiled: TiledCE, deterministic: bool = False, backend: str = "", batch_invariant: bool = False):
        self.tiled, self.deterministic, self.backend = tiled, deterministic, backend   # backend: its NAME
        self.batch_invariant = batch_invariant   # the backend's fixed tiles (``TiledCE.invariant_rows``)

    def invariant_rows(self, n_classes: int) -> int:
        """``batch_invariant``'s row multiple: the backend's token tile (``TiledCE.invariant_rows``)."""
        return self.tiled.invariant_rows(n_classes)

    def forward(self, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, stats: bool,
                entropy: bool = False):
        rows = self.tiled.forward(hidden, weight, bias, target, w, weight_sum, opts, stats, entropy,
                                  batch_invariant=self.batch_invariant)
        token_weight = None
        if opts.use_token_scaling:   # p_t = exp((z_t - lse) - lse_lo), as ``row_math.target_probability``
            token_weight = torch.where(opts.kept(target),
                                       torch.exp((rows.target_logit - rows.lse) - rows.lse_lo), 0.0)
        return rows.loss, rows.lse, rows.lse_lo, rows.predicted, token_weight, rows.entropy

    def grads(self, hidden, weight, bias, target, w, weight_sum, opts: LossOptions, grad_row, z_grad_row, needs,
              accum_dtype, saved=None, stats: bool = False, grad_entropy=None):
        if saved is None:
            raise AssertionError("TiledHead.grads recomputes from a forward's saved statistics")
        lse, lse_lo, token_weight, entropy = saved
        if token_weight is not None:
            grad_row, z_grad_row = grad_row * token_weight, z_grad_row * token_weight
        g_h, g_w, g_b = self.tiled.backward(hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row,
                                            grad_lse(lse, z_grad_row, opts), opts, needs, accum_dtype,
                                            grad_entropy, entropy, deterministic=self.deterministic,
                                            batch_invariant=self.batch_invariant)
        return None, lse, lse_lo, None, token_weight, g_h, g_w, g_b


def resolve_method(method: str) -> str:
    """``"auto"`` -> ``"chunked"`` on every device: the tiled method trades time for memory (``benchmarks/README.md``);
    names are checked by ``check_method``."""
    return "chunked" if method == "auto" else method


METHODS = ("auto", "chunked", "tiled")


def check_method(method, chunk_size) -> None:
    """``ValueError`` for a ``method`` not in ``METHODS`` and for a ``chunk_size`` with ``"tiled"``
    (which has no chunks; its tile sizes are the backend's)."""
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "tiled" and chunk_size is not None:
        raise ValueError(f"chunk_size applies to method='chunked'; with method='tiled' it must be None, "
                         f"got {chunk_size!r}")


LOGITS_DTYPES = ("float32", "input")


def check_logits_dtype(logits_dtype, method: str = "auto") -> str:
    """``ValueError`` unless ``logits_dtype`` is one of ``LOGITS_DTYPES``, or for ``"input"`` with ``method="tiled"``
    (its tiles form fp32 logits: the opt-out would be silently ignored); returns it."""
    if not isinstance(logits_dtype, str) or logits_dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits_dtype must be one of {LOGITS_DTYPES} (\"input\": the logits rounded to "
                         f"hidden's dtype, as F.linear), got {logits_dtype!r}")
    if logits_dtype == "input" and resolve_method(method) == "tiled":
        raise ValueError("logits_dtype='input' (F.linear's rounding, for stock parity) applies to "
                         "method='chunked': method='tiled' forms its logits tile by tile in fp32; use "
                         "method='chunked', or the default logits_dtype='float32'")
    return logits_dtype


def make_head(ce: ChunkCE, tiled: Optional[TiledCE], method: str, n_rows: int, hidden_size: int,
              vocab_size: int, chunk_size: Optional[int], deterministic: bool = False,
              device_type: str = "cuda", logits: str = "float32", batch_invariant: bool = False):
    """The ``head.py`` object for ``method`` (``"auto"`` resolved by ``resolve_method``); ``deterministic`` and
    ``batch_invariant`` select the tiled backward without atomics (``invariant.py``)."""
    if resolve_method(method) == "tiled":
        if tiled is None:
            raise RuntimeError("this backend has no method='tiled' (no TiledCE); use method='chunked'")
        return TiledHead(tiled, deterministic, getattr(ce, "NAME", ""), batch_invariant)
    return ChunkedHead(ce, chunk_size, logits)   # rows decided inside the loop's op (loop_ops.py)


def head_spec(head) -> tuple:
    """``(backend, tiled, chunk_size, deterministic, logits)``: constants from which ``rebuild_head`` makes the
    same head again (inside a custom op's body, ``rl/kclass_ops.py``); ``chunk_size`` 0 for the rule."""
    if isinstance(head, TiledHead):
        return head.backend, True, 0, head.deterministic, "float32"
    return head.ce.NAME, False, head.chunk_size or 0, False, head.logits


def rebuild_head(backend: str, tiled: bool, chunk_size: int, deterministic: bool, logits: str,
                 device: torch.device):
    """The head ``head_spec`` describes, with the backend's ``CHUNK_CE`` / ``TILED_CE``."""
    from fusedce import backends
    impl = backends.named(backend)
    return make_head(impl.CHUNK_CE, impl.TILED_CE, "tiled" if tiled else "chunked", 0, 0, 0, chunk_size or None,
                     deterministic, device.type, logits)


# Headroom of the forward-made gradients. The chunk kernels round dL/dlogits to hidden's dtype in the
# forward, before the upstream gradient g exists; with fp16 and loss scaling (g = S = 2^16) a dlogit
# (p_c - y_c) / D below fp16's smallest subnormal (2^-24) would be 0 before S arrives: the underflow
# loss scaling exists to prevent. So the forward forms P dL/dlogits, with (K = HEADROOM_EXP)
#     m = |logit_scale| max(max_c |w_c| / D, 1 / N),   m = f 2^e (frexp, f in [0.5, 1)),   P = 2^(K - e),
# i.e. P m in [2^(K-1), 2^K): dlogits of about 2^K |p_c - y_c| whatever D, the class weights and
# logit_scale; grad_hidden is rounded to its dtype at that scale, grad_weight / grad_bias accumulate at
# it, and the backward multiplies them by g / P in fp32. P is a power of two, so for a power-of-two g
# (a GradScaler's) that is exact: each result is rounded once, as stock's is, but from dlogits at a
# scale where fp16 keeps |p_c - y_c| down to ~2^-(24+K) (normal down to ~2^-(14+K)), not 2^-24 D / S. Overflow would need a per-logit |dL/dz| beyond ~2^(16-K) = 64 times (p - y)'s bound 1,
# or |grad_hidden| at unit scale (<= 2 max |W|) beyond 2^(16-K). bf16 / fp32: P changes no bit.
HEADROOM_EXP = 10


def headroom(scales: MeanScales, w: Optional[torch.Tensor], opts: LossOptions,
             token_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``P`` above: a 0-dim fp32 power of two on the scales' device (no host sync). ``w``: (V,) fp32
    class weights or None; ``token_weights``: (n,) fp32 per-row loss weights or None, whose largest
    finite magnitude multiplies ``m`` like the class weights' (a NaN / inf weight, not caught where the
    host check is skipped, reaches only its own row's gradients and the sums over rows, as in stock)."""
    ce = scales.ce.abs() if w is None else scales.ce.abs() * w.abs().amax()
    m = torch.maximum(ce, scales.z.abs()) * abs(opts.logit_scale)
    if token_weights is not None and token_weights.numel() > 0:
        m = m * torch.where(torch.isfinite(token_weights), token_weights.abs(), 0.0).amax()
    _, e = torch.frexp(m)   # m = 0 gives e = 0: P = 2^K, harmless (every gradient is 0)
    return torch.ldexp(torch.ones_like(m), HEADROOM_EXP - e).to(m.dtype)


def scaled_(t: Optional[torch.Tensor], g: torch.Tensor) -> Optional[torch.Tensor]:
    """``t * g`` (``g`` a 0-dim fp32 device tensor), the product formed in fp32 and rounded once to
    ``t``'s dtype. fp32 / fp64 ``t`` is scaled in place (no second V x H buffer); a bf16 / fp16 ``t``
    goes through one fp32 copy, since ``t.mul_(g)`` on CUDA first rounds ``g`` itself to ``t``'s dtype
    (a 0-dim device tensor is an operand, not a scalar): ``g / P`` = 2^-34 would be 0 in fp16."""
    if t is None:
        return None
    if t.dtype in (torch.float32, torch.float64):
        return t.mul_(g)
    return t.float().mul_(g).to(t.dtype)


def compact_rows(hidden: torch.Tensor, target: torch.Tensor, ignore_index: int):
    """``(hidden, target, index)``: the non-ignored rows and their positions, or the inputs and None
    when no row is ignored, under torch.compile / CUDA-graph capture (no host sync allowed), with fake or
    meta tensors or under make_fx / export tracing (no values to count), or for an
    empty batch. The one documented host sync of the linear ops (the count of kept rows)."""
    if hidden.shape[0] == 0 or not host_readable(hidden, target):
        return hidden, target, None
    index = (target != ignore_index).nonzero().squeeze(1)
    if index.shape[0] == hidden.shape[0]:
        return hidden, target, None
    return hidden.index_select(0, index), target.index_select(0, index), index


def scatter_rows(values: torch.Tensor, index: Optional[torch.Tensor], n: int, fill) -> torch.Tensor:
    """``values`` (n', ...) of the kept rows back at their positions ``index`` in a new (n,) tensor filled
    with ``fill`` elsewhere (ignored rows); ``values`` itself when nothing was compacted (index None)."""
    if index is None:
        return values
    out = torch.full((n,), fill, dtype=values.dtype, device=values.device)
    return out.index_copy(0, index, values)


class LinearHeadFunction(torch.autograd.Function):
    """The autograd skeleton of the linear cross-entropy heads (class indices and probabilities): gradients made
    in the forward times the headroom for mean / sum, recomputed for "none", tiled and a second backward
    (``docs/lm_head.md``). Returns ``(loss, lse, predicted, factor)``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, head, w, weight_sum, opts, reduction, scale_pair, accum_dtype,
                stats, needs, token_weights):
        # scale_pair (2,) = (1/D, 1/N): one tensor (an autograd.Function may not take one tensor twice under
        # torch.compile); token_weights: (n,) fp32 constants (0 on ignored rows) or None
        ctx.grads = None
        scales = MeanScales(scale_pair[0], scale_pair[1])
        if reduction == "none" or not head.grads_in_forward:
            loss, lse, lse_lo, predicted, factor, state = head.rows_forward(hidden, weight, bias, target, w,
                                                                            weight_sum, opts, stats)
        else:   # gradients made here, times P (``headroom``); the backward applies g / P
            n = hidden.shape[0]
            p = headroom(scales, w, opts, token_weights)
            ctx.unscale = 1.0 / p   # exact: a power of two
            grad_row, z_grad_row = (_weighted((s * p).expand(n), token_weights) for s in scales)
            loss, lse, lse_lo, predicted, factor, state, *ctx.grads = head.rows_grads(
                hidden, weight, bias, target, w, weight_sum, opts, grad_row, z_grad_row, needs, accum_dtype,
                stats=stats)
        out = reduce(*token_scaled(loss, z_rows(lse, opts), times(factor, token_weights)), reduction, scales,
                     loss.shape)
        factor = lse.new_empty(0) if factor is None else factor
        predicted = lse.new_empty(0, dtype=torch.int64) if predicted is None else predicted
        ctx.stateful = state is not None
        ctx.save_for_backward(hidden, weight, bias, target, w, weight_sum, lse, lse_lo, scale_pair, factor, state,
                              token_weights)
        ctx.head, ctx.opts, ctx.accum, ctx.needs, ctx.reduction = head, opts, accum_dtype, needs, reduction
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(lse, predicted, factor)
        return out, lse, predicted, factor

    @staticmethod
    @backward_formula
    def backward(ctx, grad_out, _grad_lse, _grad_pred, _grad_factor):
        check_backward_allowed(ctx, "fusedce.linear_cross_entropy")
        if ctx.grads is not None:   # the first backward of chunked mean / sum: scale what the forward made
            (g_h, g_w, g_b), ctx.grads = ctx.grads, None
            g = grad_out.float() * ctx.unscale
            g_h, g_w, g_b = (scaled_(t, g) for t in (g_h, g_w, g_b))
        else:                       # "none", tiled, or a second backward: recompute from the saved inputs
            hidden, weight, bias, target, w, weight_sum, lse, lse_lo, scale_pair, factor, state, token_weights = (
                ctx.saved_tensors)
            n = hidden.shape[0]
            if ctx.reduction == "none":
                grad_row = z_grad_row = grad_out
            else:
                g = grad_out.float()
                grad_row, z_grad_row = (scale_pair[0] * g).expand(n), (scale_pair[1] * g).expand(n)
            grad_row, z_grad_row = _weighted(grad_row, token_weights), _weighted(z_grad_row, token_weights)
            saved = (lse, lse_lo, factor if ctx.opts.use_token_scaling else None, state if ctx.stateful else None)
            *_, g_h, g_w, g_b = ctx.head.rows_grads(hidden, weight, bias, target, w, weight_sum, ctx.opts, grad_row,
                                                    z_grad_row, ctx.needs, ctx.accum, saved=saved)
        g_w = None if g_w is None else g_w.to(ctx.dtypes[0])
        g_b = None if g_b is None else g_b.to(ctx.dtypes[1])
        return (g_h, g_w, g_b) + (None,) * (_N_INPUTS - 3)


_N_INPUTS = len(inspect.signature(LinearHeadFunction.forward).parameters) - 1   # forward's inputs, ctx excluded


def _weighted(grad_row: torch.Tensor, token_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """A per-row upstream gradient times the user's per-row loss weights (None: unchanged)."""
    return grad_row if token_weights is None else grad_row * token_weights
