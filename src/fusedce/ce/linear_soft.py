"""``linear_cross_entropy`` with probability ("soft") targets: the autograd Function around the soft heads
(``lm_head/soft_loop.py``) and the op after ``ce/checks.py``.
``functional.linear_cross_entropy`` dispatches here when its ``target`` is a floating-point tensor.

Semantics: exactly ``cross_entropy``'s with a float target (``ce/soft_targets.py``) on the logits
``hidden @ weight.T + bias``: per row ``-sum_c w_c q'_c log softmax(z)_c``, ``q' = (1 - eps) q + eps / V``;
no row ignored; ``"mean"`` divides the loss and the z-loss by the number of rows (or
``num_items_in_batch``). Gradients: mean / sum chunked made in the forward times the power-of-two
headroom (``lm_head/headroom.py``) as the class-index path; "none" and tiled recompute in backward.
One host sync: the check that no value of the target is negative, NaN or +inf (``validation.check_probabilities``,
the target-range check's rule: skipped under torch.compile and CUDA-graph capture).
"""
from __future__ import annotations

import inspect

import torch

from fusedce import backends
from fusedce.core import reduction as red
from fusedce.core.autocast import backward_formula
from fusedce.core.autograd_checks import check_backward_allowed
from fusedce.lm_head.headroom import headroom, scaled_
from fusedce.lm_head.soft_loop import make_soft_head


def _weighted(grad_row, token_weights):
    return grad_row if token_weights is None else grad_row * token_weights


class _LinearSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, q, head, w, opts, reduction, scale_pair, accum_dtype, stats, needs,
                token_weights):
        ctx.grads = None
        scales = red.MeanScales(scale_pair[0], scale_pair[1])
        if reduction == "none" or not head.grads_in_forward:
            loss, lse, lse_lo, a, predicted = head.forward(hidden, weight, bias, q, w, opts, stats)
        else:   # gradients made here, times P (``headroom``); the backward applies g / P
            n = hidden.shape[0]
            p = headroom(scales, w, opts, token_weights)
            ctx.unscale = 1.0 / p
            grad_row, z_grad_row = (_weighted((s * p).expand(n), token_weights) for s in scales)
            loss, lse, lse_lo, a, predicted, *ctx.grads = head.grads(hidden, weight, bias, q, w, opts, grad_row,
                                                                     z_grad_row, needs, accum_dtype, stats=stats)
        out = red.reduce(*red.token_scaled(loss, red.z_rows(lse, opts), token_weights), reduction, scales,
                         loss.shape)
        ctx.save_for_backward(hidden, weight, bias, q, w, lse, lse_lo, a, scale_pair, token_weights)
        ctx.head, ctx.opts, ctx.accum, ctx.needs, ctx.reduction = head, opts, accum_dtype, needs, reduction
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        if predicted is None:
            predicted = lse.new_empty(0, dtype=torch.int64)
        ctx.mark_non_differentiable(lse, predicted)
        return out, lse, predicted

    @staticmethod
    @backward_formula
    def backward(ctx, grad_out, _grad_lse, _grad_pred):
        check_backward_allowed(ctx, "fusedce.linear_cross_entropy")
        if ctx.grads is not None:
            (g_h, g_w, g_b), ctx.grads = ctx.grads, None
            g = grad_out.float() * ctx.unscale
            g_h, g_w, g_b = (scaled_(t, g) for t in (g_h, g_w, g_b))
        else:
            hidden, weight, bias, q, w, lse, lse_lo, a, scale_pair, token_weights = ctx.saved_tensors
            n = hidden.shape[0]
            if ctx.reduction == "none":
                grad_row = z_grad_row = grad_out.reshape(n)
            else:
                g = grad_out.float()
                grad_row, z_grad_row = (scale_pair[0] * g).expand(n), (scale_pair[1] * g).expand(n)
            grad_row, z_grad_row = _weighted(grad_row, token_weights), _weighted(z_grad_row, token_weights)
            *_, g_h, g_w, g_b = ctx.head.grads(hidden, weight, bias, q, w, ctx.opts, grad_row, z_grad_row,
                                               ctx.needs, ctx.accum, saved=(lse, lse_lo, a))
        g_w = None if g_w is None else g_w.to(ctx.dtypes[0])
        g_b = None if g_b is None else g_b.to(ctx.dtypes[1])
        return (g_h, g_w, g_b) + (None,) * (_N_INPUTS - 3)


_N_INPUTS = len(inspect.signature(_LinearSoftCE.forward).parameters) - 1


def linear_cross_entropy(call, hidden, weight, bias):
    """The op on a checked ``CECall`` (``ce/checks.py``) with probability targets, ``hidden`` (BT, H). Returns
    the fp32 loss or ``CrossEntropyOutput`` (``token_accuracy``: the argmax of the logits equals the argmax of
    the target, every row counted; one more read of the target)."""
    opts, reduction, q, spec, n = call.opts, call.reduction, call.target, call.head, hidden.shape[0]
    w = None if call.class_weights is None else call.class_weights.float()
    factor = call.token_weights
    scales = call.scales
    if scales is None:
        one = torch.ones((), device=hidden.device)
        scales = red.MeanScales(one, one)
    head = make_soft_head(backends.named(call.backend), spec.method, n, hidden.shape[-1], weight.shape[0], spec.rows,
                          hidden.device.type, spec.logits)
    needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and any(needs):
        loss, lse, predicted = _LinearSoftCE.apply(hidden, weight, bias, q, head, w, opts, reduction,
                                                   torch.stack(scales), spec.accum_dtype, call.return_stats, needs,
                                                   factor)
    else:
        with torch.no_grad():
            rows, lse, _lo, _a, predicted = head.forward(hidden, weight, bias, q, w, opts, call.return_stats)
            loss = red.reduce(*red.token_scaled(rows, red.z_rows(lse, opts), factor), reduction, scales, rows.shape)
    if reduction == "none":
        loss = loss.reshape(call.lead)
    if not call.return_stats:
        return loss
    expected = q.argmax(dim=1)
    return red.stats(loss, lse, predicted, expected, opts, reduction, call.scales, call.lead, factor,
                     valid=torch.ones_like(expected, dtype=torch.bool))
