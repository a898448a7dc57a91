"""The student's tail for ``topk_distillation_loss(..., tail=True)`` (``distill/topk.py``): per token ``log s_tail``,
the log of the student's softmax mass OUTSIDE the teacher's K classes, computed from the row statistics with those
classes excluded, never as ``1 - sum_k s_k``."""
from __future__ import annotations

import torch

from fusedce.backends.pytorch import launch
from fusedce.backends.pytorch import tuning as torch_tuning
from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.core.options import LossOptions
from fusedce.core.row_math import mul_slope_, transform
from fusedce.lm_head import kinds
from fusedce.lm_head.kinds import Args, loss_args, register


Tensor = torch.Tensor
_WIDE_ELEMENTS = 1 << 21   # logits per block of whole rows (``wide``): 8 MiB of fp32 per temporary


def _blocks(n: int, n_classes: int, wide: bool, split: int = 1):
    """(vocabulary slices, row slices) of the blocks: ``wide`` (the logits form, and the LM head's
    chunked method, which holds a chunk of whole rows anyway) rows cut in ``split`` vocabulary blocks,
    as many rows as fit in ``_WIDE_ELEMENTS`` (at most 512); otherwise the PyTorch tiled method's ``rows
    x vocab < V`` (``tile_sizes``, read at call time)."""
    if wide:
        vocab = max(1, -(-n_classes // split))
        rows = max(1, min(512, _WIDE_ELEMENTS // vocab))
    else:
        rows, vocab = torch_tuning.tile_sizes(n_classes)
    return [slice(v, v + vocab) for v in range(0, n_classes, vocab)], [slice(r, r + rows) for r in range(0, n, rows)]


def _threads(device) -> int:
    return torch.get_num_threads() if device.type == "cpu" else 1


def _tail_mask(ids: torch.Tensor, v: slice, width: int) -> torch.Tensor:
    """(rows, width) bool: True on the classes of block ``v`` NOT among the row's excluded ``ids``
    ((rows, K) int64, -1 where an entry excludes nothing)."""
    inside = (ids >= v.start) & (ids < v.start + width)
    cols = torch.where(inside, ids - v.start, width)   # column ``width``: a spare for the entries elsewhere
    hit = torch.zeros(ids.shape[0], width + 1, dtype=torch.bool, device=ids.device)
    hit.scatter_(1, cols, True)
    return ~hit[:, :width]


def _merge(m, s, q):
    """One online-softmax step: ``(m, s)`` (``s = sum exp(. - m)``) merged with the rows of block ``q``
    (-inf entries add nothing; safe when everything so far is -inf)."""
    new_m = torch.maximum(m, q.amax(1))
    ref = torch.where(torch.isinf(new_m), 0.0, new_m)
    s = s * torch.exp(torch.where(torch.isinf(m), float("-inf"), m) - ref) + torch.exp(q - ref[:, None]).sum(1)
    return new_m, s


def _forward(block_logits, ids, n: int, n_classes: int, opts: LossOptions, device, wide: bool):
    """Per row ``(m, s, mt, st)`` fp32 over every block of ``block_logits(r, v)`` (fp32 raw logits)."""
    m = torch.full((n,), float("-inf"), device=device)
    mt, s, st = m.clone(), torch.zeros(n, device=device), torch.zeros(n, device=device)
    vocab_blocks, row_blocks = _blocks(n, n_classes, wide)

    def share(k, workers):
        for r in row_blocks[k::workers]:
            mr, mtr = m[r].clone(), mt[r].clone()
            sr, str_ = s[r].clone(), st[r].clone()
            for v in vocab_blocks:
                q = transform(block_logits(r, v), opts)
                qt = torch.where(_tail_mask(ids[r], v, q.shape[1]), q, float("-inf"))
                mr, sr = _merge(mr, sr, q)
                mtr, str_ = _merge(mtr, str_, qt)
            m[r], s[r], mt[r], st[r] = mr, sr, mtr, str_

    launch.run(share, len(row_blocks), device)
    return m, s, mt, st


def _log_tail(m, s, mt, st) -> torch.Tensor:
    return torch.where(st > 0, (mt - m) + torch.log(st / s), float("-inf"))


def _lses(m, s, mt, st):
    """``(lse, lse_t)`` for the backward; ``lse_t`` +inf on rows without a tail class (their tail term is
    masked anyway), so that no NaN is formed."""
    return m + torch.log(s), torch.where(st > 0, mt + torch.log(st), float("inf"))


def _block_grad(block_logits, ids, r, v, g, lse, lse_t, opts: LossOptions):
    """dL/dx of one block (fp32): ``g (mask exp(q - lse_t) - exp(q - lse))`` times ``dq/dx``; exactly 0
    on rows with ``g == 0`` (ignored tokens, tokens without a teacher tail), whatever their logits."""
    q = transform(block_logits(r, v), opts)
    keep = _tail_mask(ids[r], v, q.shape[1])
    inner = torch.where(keep, torch.exp(q - lse_t[r, None]), 0.0) - torch.exp(q - lse[r, None])
    gr = g[r, None]
    return torch.where(gr != 0, mul_slope_(gr * inner, q, opts), 0.0)


def _logits_grad(logits, ids, m, s, mt, st, g, opts: LossOptions):
    """dL/dlogits (logits' shape and dtype) of ``sum_r g[r] log s_tail[r]``."""
    lse, lse_t = _lses(m, s, mt, st)
    g = g.float()
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    block = _logit_blocks(logits)
    vocab_blocks, row_blocks = _blocks(logits.shape[0], logits.shape[1], True)

    def share(k, workers):   # row blocks k, k + workers, ...: disjoint rows of grad
        for r in row_blocks[k::workers]:
            for v in vocab_blocks:
                grad[r, v] = _block_grad(block, ids, r, v, g, lse, lse_t, opts).to(grad.dtype)

    launch.run(share, len(row_blocks), logits.device)
    return grad


def _head_grads(hidden, weight, bias, ids, m, s, mt, st, g, opts: LossOptions, wide: bool, needs):
    """``(grad_hidden, grad_weight, grad_bias)`` fp32 (None where ``needs`` says no) of ``sum_r g[r] log
    s_tail[r]`` for the LM head."""
    lse, lse_t = _lses(m, s, mt, st)
    g = g.float()
    need_h, need_w, need_b = needs
    f32 = dict(dtype=torch.float32, device=hidden.device)
    g_h = torch.zeros(hidden.shape, **f32) if need_h else None
    g_w = torch.zeros(weight.shape, **f32) if need_w else None
    g_b = torch.zeros(weight.shape[0], **f32) if need_b else None
    block = _head_blocks(hidden, weight, bias)
    # the shares take vocabulary blocks (disjoint rows of grad_weight): whole rows cut in one per thread
    vocab_blocks, row_blocks = _blocks(hidden.shape[0], weight.shape[0], wide, _threads(hidden.device))

    def share(k, workers):   # vocabulary blocks k, k + workers, ...: disjoint rows of grad_weight
        acc_h = g_h if k == 0 or g_h is None else torch.zeros_like(g_h)
        for v in vocab_blocks[k::workers]:
            w32 = weight[v].float()
            for r in row_blocks:
                dx = _block_grad(block, ids, r, v, g, lse, lse_t, opts)
                if acc_h is not None:
                    acc_h[r] += dx @ w32
                if need_w:
                    g_w[v] += dx.t() @ hidden[r].float()
                if need_b:
                    g_b[v] += dx.sum(0)
        return acc_h

    g_h = launch.add_shares(g_h, launch.run(share, len(vocab_blocks), hidden.device))
    return g_h, g_w, g_b


# ---------------------------------------------------------------- the loops as kinds (``lm_head/kinds.py``)
# Traced, the loops' ``launch.run`` hits ``torch.is_inference_mode_enabled`` (Dynamo refused the graph), and a
# loop over the token count would specialize the graph on it: each is a kind of the two loop ops.

def _stats_fake(a: Args) -> list:
    return [a.t[0].new_empty(a.t[0].shape[0], dtype=torch.float32) for _ in range(4)]


@register("tail_logits")
class _LogitsKind:
    """Tensors ``logits, ids`` (the backward's then ``m, s, mt, st, g``); ints ``ignore_index``."""
    forward_fake = staticmethod(_stats_fake)

    @staticmethod
    def forward(a: Args) -> list:
        logits, ids = a.t
        return list(_forward(_logit_blocks(logits), ids, logits.shape[0], logits.shape[1], a.opts(), logits.device,
                             True))

    @staticmethod
    def backward(a: Args) -> list:
        return [_logits_grad(*a.t, a.opts())]

    @staticmethod
    def backward_fake(a: Args) -> list:
        return [torch.empty_like(a.t[0], memory_format=torch.contiguous_format)]


@register("tail_head")
class _HeadKind:
    """Tensors ``hidden, weight, bias, ids`` (the backward's then ``m, s, mt, st, g``); ints ``ignore_index,
    wide`` (the backward's then ``needs`` x3); grads fp32."""
    forward_fake = staticmethod(_stats_fake)

    @staticmethod
    def forward(a: Args) -> list:
        hidden, weight, bias, ids = a.t
        return list(_forward(_head_blocks(hidden, weight, bias), ids, hidden.shape[0], weight.shape[0], a.opts(),
                             hidden.device, bool(a.i[1])))

    @staticmethod
    def backward(a: Args) -> list:
        grads = _head_grads(*a.t, a.opts(), bool(a.i[1]), tuple(map(bool, a.i[2:5])))
        return [a.t[0].new_empty(0, dtype=torch.float32) if t is None else t for t in grads]

    @staticmethod
    def backward_fake(a: Args) -> list:
        hidden, weight = a.t[:2]
        return [hidden.new_empty(s if need else (0,), dtype=torch.float32)
                for s, need in zip((hidden.shape, weight.shape, weight.shape[:1]), a.i[2:5])]


class _TailLogits(torch.autograd.Function):
    """``log s_tail`` (n,) fp32 of ``logits`` (n, V), ``ids`` (n, K) the excluded classes (-1: none)."""

    @staticmethod
    def forward(ctx, logits, ids, opts: LossOptions):
        m, s, mt, st = logits_stats(logits, ids, opts)
        ctx.save_for_backward(logits, ids, m, s, mt, st)
        ctx.opts = opts
        return _log_tail(m, s, mt, st)

    @staticmethod
    @backward_formula
    def backward(ctx, g):
        check_backward_allowed(ctx, "fusedce.topk_distillation_loss(tail=True)")
        logits, ids, m, s, mt, st = ctx.saved_tensors
        return logits_grad(logits, ids, (m, s, mt, st), g, ctx.opts), None, None


class _TailLinear(torch.autograd.Function):
    """``log s_tail`` (n,) fp32 of ``hidden @ weight.T + bias`` (fp32 from the operands' values), never
    holding more than one (rows x vocab) block of logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, opts: LossOptions, wide: bool):
        m, s, mt, st = head_stats(hidden, weight, bias, ids, opts, wide)
        ctx.save_for_backward(hidden, weight, bias, ids, m, s, mt, st)
        ctx.opts, ctx.wide = opts, wide
        return _log_tail(m, s, mt, st)

    @staticmethod
    @backward_formula
    def backward(ctx, g):
        check_backward_allowed(ctx, "fusedce.linear_topk_distillation_loss(tail=True)")
        hidden, weight, bias, ids, m, s, mt, st = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:3])
        g_h, g_w, g_b = head_grads(hidden, weight, bias, ids, (m, s, mt, st), g, ctx.opts, ctx.wide, needs)
        return (g_h.to(hidden.dtype) if needs[0] else None, g_w.to(weight.dtype) if needs[1] else None,
                g_b.to(bias.dtype) if needs[2] else None, None, None, None)


def _logit_blocks(logits):
    def block(r, v):
        return logits[r, v].float()
    return block


def _head_blocks(hidden, weight, bias):
    """``block(r, v)``: fp32 ``hidden[r] @ weight[v].T + bias[v]`` from the operands' values."""
    def block(r, v):
        return torch.nn.functional.linear(hidden[r].float(), weight[v].float(),
                                          None if bias is None else bias[v].float())
    return block


def log_tail_logits(logits: torch.Tensor, ids: torch.Tensor, opts: LossOptions) -> torch.Tensor:
    """``log s_tail`` (n,) fp32 of checked ``logits`` (n, V) (any row stride), excluding ``ids`` (n, K)
    int64 (-1: an entry that excludes nothing); differentiable w.r.t. ``logits``."""
    return _TailLogits.apply(logits, ids, opts)


def log_tail_linear(hidden, weight, bias, ids: torch.Tensor, opts: LossOptions, method: str) -> torch.Tensor:
    """As :func:`log_tail_logits` for the logits ``hidden (n, H) @ weight (V, H).T + bias (V,)``; differentiable w.r.t.
    the three."""
    return _TailLinear.apply(hidden, weight, bias, ids, opts, method == "chunked")


# ---------------------------------------------------------------- the passes on a vocabulary slice
# The vocab-parallel form (``distributed/topk_tail.py``) runs the same ops on its slice and exchanges the
# statistics ``(m, s, mt, st)`` between them: ``ids`` are then LOCAL columns (a class outside the slice is
# out of ``[0, V_r)`` and masks nothing), and the backward takes the exchanged (global) statistics.

def logits_stats(logits: torch.Tensor, ids: torch.Tensor, opts: LossOptions) -> tuple:
    """Per row ``(m, s, mt, st)`` fp32 (n,) of ``logits`` (n, V) over all classes and over the classes not
    in ``ids`` (n, K) (``s = sum exp(q - m)``, ``q`` the transformed logits; an empty row: ``-inf, 0``)."""
    return tuple(kinds.forward("tail_logits", [logits, ids], *loss_args(opts)))


def logits_grad(logits: torch.Tensor, ids: torch.Tensor, stats, g: torch.Tensor, opts: LossOptions):
    """dL/dlogits (logits' shape and dtype) of ``sum_r g[r] log s_tail[r]``, ``stats`` the row's
    ``(m, s, mt, st)`` over the whole vocabulary."""
    return kinds.backward("tail_logits", [logits, ids, *stats, g.contiguous()], *loss_args(opts))[0]


def head_stats(hidden, weight, bias, ids: torch.Tensor, opts: LossOptions, wide: bool) -> tuple:
    """:func:`logits_stats` of ``hidden @ weight.T + bias`` (fp32 from the operands' values), in blocks
    (``wide``: whole rows; otherwise fewer than V logits a block)."""
    return tuple(kinds.forward("tail_head", [hidden, weight, bias, ids], *loss_args(opts, wide)))


def head_grads(hidden, weight, bias, ids: torch.Tensor, stats, g: torch.Tensor, opts: LossOptions, wide: bool,
               needs) -> tuple:
    """``(grad_hidden, grad_weight, grad_bias)`` fp32 (None where ``needs`` says no) of ``sum_r g[r] log
    s_tail[r]``; ``grad_hidden`` the sum over this head's classes only."""
    out = kinds.backward("tail_head", [hidden, weight, bias, ids, *stats, g.contiguous()],
                         *loss_args(opts, wide, *needs))
    return tuple(t if need else None for t, need in zip(out, needs))


def log_tail_of(stats) -> torch.Tensor:
    """``log s_tail`` (n,) fp32 from a row's ``(m, s, mt, st)``; ``-inf`` where no class is outside ``ids``."""
    return _log_tail(*stats)
