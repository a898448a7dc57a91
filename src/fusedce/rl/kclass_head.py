"""Log-probabilities of K given classes per row (``token_log_probs`` with a ``target`` of shape ``(..., K)``), on any
backend's ``ChunkCE`` / ``TiledCE``, with no new kernel."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.core.options import LossOptions
from fusedce.core.row_math import mul_slope_, transform
from fusedce.lm_head import loop
from fusedce.lm_head.head import TiledHead
from fusedce.rl.kclass_head_tiled import sparse_grads_, target_logits
from fusedce.backends.protocol import ChunkCE

_SAME_CLASS_ELEMENTS = 1 << 22   # the (rows, K, K) class-equality temporary of ``class_sums``

class Entries(NamedTuple):
    """The K targets of n rows: ``valid`` / ``safe`` (n, K), the representative target ``rep`` (n,), the first
    valid entry's position ``first`` (n, 1) and ``any`` (n,)."""

    valid: torch.Tensor
    safe: torch.Tensor
    rep: torch.Tensor
    first: torch.Tensor
    any: torch.Tensor


def entries(target: torch.Tensor, opts: LossOptions, n_classes: int) -> Entries:
    valid = opts.kept(target) & (target >= 0) & (target < n_classes)
    safe = torch.where(valid, target, 0).long()
    first = valid.to(torch.uint8).argmax(dim=1, keepdim=True)   # the first maximum: the first valid entry
    any_valid = valid.any(dim=1)
    rep = torch.where(any_valid, safe.gather(1, first)[:, 0], opts.ignore_index)
    return Entries(valid, safe, rep, first, any_valid)


def log_probs_at(x: torch.Tensor, target: torch.Tensor, e: Entries, lse, lse_lo, opts: LossOptions):
    """fp32 ``(z_k - lse) - lse_lo`` from the gathered logits ``x`` (n, K); 0 on ignored entries, NaN on
    a non-ignored entry out of range (as the one-class loss)."""
    return log_probs_of(transform(x.float(), opts), target, e, lse, lse_lo, opts)


def log_probs_of(z: torch.Tensor, target: torch.Tensor, e: Entries, lse, lse_lo, opts: LossOptions):
    """:func:`log_probs_at` from the TRANSFORMED fp32 target logits ``z`` (n, K) (the vocab-parallel op
    sums them over the ranks first)."""
    out = (z - lse[:, None]) - lse_lo[:, None]
    out = torch.where(e.valid, out, float("nan"))
    return torch.where(opts.kept(target), out, 0.0)


def class_sums(e: Entries, g: torch.Tensor) -> torch.Tensor:
    """``sum_{j: t_j = t_k} g_j`` per entry (n, K) fp32: a masked (K, K) product per row, rows at a time so that the
    (rows, K, K) temporary stays below ``_SAME_CLASS_ELEMENTS``."""
    ids = torch.where(e.valid, e.safe, -1)
    n, K = ids.shape
    if torch.compiler.is_compiling():   # one block: a loop over the token count would specialize the graph on it
        return torch.where(ids[:, :, None] == ids[:, None, :], g[:, None, :], 0.0).sum(dim=-1)
    total = torch.empty_like(g)
    rows = max(1, _SAME_CLASS_ELEMENTS // (K * K))
    for s in range(0, n, rows):
        c = slice(s, s + rows)
        same = ids[c, :, None] == ids[c, None, :]
        total[c] = torch.where(same, g[c, None, :], 0.0).sum(dim=-1)
    return total


def upstream_k(grad_log_probs: Optional[torch.Tensor], e: Entries):
    """(g (n, K) fp32, 0 on ignored entries; G (n,) = sum_k g_k)."""
    if grad_log_probs is None:
        g = torch.zeros(e.valid.shape, dtype=torch.float32, device=e.valid.device)
    else:
        g = torch.where(e.valid, grad_log_probs.float(), 0.0)
    return g, g.sum(dim=1)


def column_grads(x: torch.Tensor, e: Entries, kept_rows: torch.Tensor, g, G, lse, lse_lo, k, entropy,
                 opts: LossOptions) -> torch.Tensor:
    """The module docstring's whole formula, fp32 (n, K), at the entries of ``e`` (their logits ``x`` before the
    transform): ``class_sums`` over ``e``'s valid entries; the entropy term on the rows ``kept_rows`` (n,) bool."""
    z = transform(x.float(), opts)
    u = (z - lse[:, None]) - lse_lo[:, None]
    p = torch.exp(u)
    dz = -G[:, None] * p + class_sums(e, g)
    if k is not None:
        kk = torch.where(kept_rows, k.float(), 0.0)
        dz = dz - kk[:, None] * torch.where(p == 0.0, 0.0, p * (u + entropy[:, None]))
    return mul_slope_(dz, z, opts)   # dz is a fresh tensor


def scatter_columns_(grad: torch.Tensor, dz: torch.Tensor, e: Entries, keep_unwritten: bool = False) -> None:
    """Write ``dz`` (n, K) at the valid entries' columns of ``grad`` ((n, V)), rounded once to its dtype."""
    cols = torch.where(e.valid, e.safe, e.safe.gather(1, e.first))
    dz = torch.where(e.valid, dz, dz.gather(1, e.first)).to(grad.dtype)
    other = grad.gather(1, cols) if keep_unwritten else torch.zeros((), dtype=grad.dtype, device=grad.device)
    grad.scatter_(1, cols, torch.where(e.any[:, None], dz, other))


def _fix_columns_(grad: torch.Tensor, x: torch.Tensor, e: Entries, g, G, lse, lse_lo, k, entropy,
                  opts: LossOptions) -> None:
    """Overwrite the K target columns of ``grad`` ((n, V), any float dtype) with the exact fp32 value of the module
    docstring's formula, rounded once."""
    scatter_columns_(grad, column_grads(x, e, e.any, g, G, lse, lse_lo, k, entropy, opts), e)


class _KClassCE:
    """A ``ChunkCE`` whose ``grad_`` takes (n, K) targets and upstream gradients (``loop.grads_loop`` slices
    both by rows): the one-class kernel with ``grad_lse = -G``, then ``_fix_columns_``."""

    def __init__(self, ce: ChunkCE, n_classes: int):
        self.ce, self.n_classes = ce, n_classes

    def grad_(self, logits, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, opts, grad_entropy=None,
              entropy=None, out=None):
        e = entries(target, opts, self.n_classes)
        x = logits.gather(1, e.safe)   # read before the kernel overwrites the chunk
        g, G = upstream_k(grad_row, e)
        self.ce.grad_(logits, e.rep, None, None, lse, lse_lo, G.new_zeros(()).expand(G.shape[0]), -G, opts,
                      grad_entropy=grad_entropy, entropy=entropy, out=out)
        _fix_columns_(logits if out is None else out, x, e, g, G, lse, lse_lo, grad_entropy, entropy, opts)


def _entropy_or_empty(entropy, like):
    return like.new_empty(0) if entropy is None else entropy


class _LogProbsK(torch.autograd.Function):
    """Logits given: the backend's ChunkCE on all rows at once."""

    @staticmethod
    def forward(ctx, logits, target, ce, opts: LossOptions, want_entropy: bool):
        e = entries(target, opts, logits.shape[1])
        out = ce.loss(logits, e.rep, None, None, opts, False, want_entropy)
        lse, lse_lo = out[1], out[2]
        entropy = _entropy_or_empty(out[4] if want_entropy else None, lse)
        log_probs = log_probs_at(logits.gather(1, e.safe), target, e, lse, lse_lo, opts)
        ctx.save_for_backward(logits, target, lse, lse_lo, entropy)
        ctx.ce, ctx.opts, ctx.want_entropy, ctx.consumed = ce, opts, want_entropy, False
        return log_probs, entropy

    @staticmethod
    @backward_formula
    def backward(ctx, grad_log_probs, grad_entropy):
        check_backward_allowed(ctx, "fusedce.token_log_probs")
        logits, target, lse, lse_lo, entropy = ctx.saved_tensors
        k = grad_entropy if ctx.want_entropy else None
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        _KClassCE(ctx.ce, logits.shape[1]).grad_(logits, target, None, None, lse, lse_lo, grad_log_probs, None,
                                                 ctx.opts, grad_entropy=k, entropy=entropy, out=grad)
        return grad, None, None, None, None


def linear_forward(head, hidden, weight, bias, target, opts: LossOptions, want_entropy: bool):
    """The linear K-class forward on a ``head.py`` head: ``(lse, lse_lo, entropy or None, x)``, ``x`` (n, K)
    the target logits before the transform (the chunk logits' dtype; fp32 with the tiled head)."""
    e = entries(target, opts, weight.shape[0])
    if isinstance(head, TiledHead):
        rows = head.tiled.forward(hidden, weight, bias, e.rep, None, None, opts, False, want_entropy)
        return rows.lse, rows.lse_lo, rows.entropy, target_logits(hidden, weight, bias, e.safe)
    return _chunked_forward(head, hidden, weight, bias, e, opts, want_entropy)


def linear_grads(head, hidden, weight, bias, target, lse, lse_lo, entropy, x, grad_log_probs, k, opts: LossOptions,
                 needs) -> tuple:
    """The linear K-class backward: ``(grad_hidden, grad_weight, grad_bias)`` (None where ``needs`` says no;
    the last two fp32) of ``sum_k g_k log p_k (+ k entropy)``, ``g = grad_log_probs`` (n, K) or None, ``k``
    the entropy's upstream (n,) or None."""
    e = entries(target, opts, weight.shape[0])
    g, G = upstream_k(grad_log_probs, e)
    if isinstance(head, TiledHead):
        zero = G.new_zeros(()).expand(G.shape[0])
        grads = head.tiled.backward(hidden, weight, bias, e.rep, None, None, lse, lse_lo, zero, -G, opts,
                                    needs, torch.float32, k, entropy if k is not None else None,
                                    deterministic=head.deterministic)
        d = mul_slope_(g.clone(), transform(x.float(), opts), opts)
        return sparse_grads_(grads, hidden, weight, d, e.safe, needs, head.deterministic)
    saved = (lse, lse_lo, None, entropy if k is not None else None)
    *_, g_h, g_w, g_b = loop.grads_loop(_KClassCE(head.ce, weight.shape[0]), hidden, weight, bias, target, None,
                                   None, opts, head.rows_for(hidden, weight), g, g, needs, torch.float32,
                                   saved=saved, grad_entropy=k, logits=head.logits)
    return g_h, g_w, g_b


def _chunked_forward(head, hidden, weight, bias, e: Entries, opts: LossOptions, want_entropy: bool):
    """Per chunk of ``head.rows_for`` tokens: the logits once, ``ce.loss`` on the representative targets and
    the K target logits gathered from the chunk. ``(lse, lse_lo, entropy or None, x (n, K))``."""
    n = hidden.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse_lo = torch.empty_like(lse)
    entropy = torch.empty_like(lse) if want_entropy else None
    x = torch.empty(e.safe.shape, dtype=loop.logits_dtype(hidden.dtype, head.logits), device=hidden.device)
    rows = head.rows_for(hidden, weight)
    buffer = loop.chunk_buffer(n, rows, weight, hidden.dtype, head.logits)
    for s in range(0, n, rows):
        c = slice(s, s + rows)
        logits = loop.logits_chunk(hidden[c], weight, bias, buffer, head.logits)
        out = head.ce.loss(logits, e.rep[c], None, None, opts, False, want_entropy)
        lse[c], lse_lo[c] = out[1], out[2]
        if want_entropy:
            entropy[c] = out[4]
        x[c] = logits.gather(1, e.safe[c])
        del logits
    return lse, lse_lo, entropy, x


def token_log_probs_kclass(ce: ChunkCE, logits: torch.Tensor, target: torch.Tensor, opts: LossOptions,
                          want_entropy: bool):
    """Backend entry: ``logits`` (BT, V) last-dim stride 1, ``target`` (BT, K) -> ``(log_probs (BT, K),
    entropy (BT,) or empty)`` fp32."""
    return _LogProbsK.apply(logits, target, ce, opts, want_entropy)
