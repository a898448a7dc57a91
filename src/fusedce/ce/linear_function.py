"""The class-index linear op around the heads' autograd skeleton (``lm_head/head.LinearHeadFunction``);
its gradient schedule (mean / sum in forward, "none" recomputed, ignored rows compacted) is in
``docs/internals.md``, "``ce/linear_function.py``"."""
from __future__ import annotations

import torch

from fusedce import backends
from fusedce.core.reduction import MeanScales, reduce, times, token_scaled, z_rows
from fusedce.lm_head import invariant
from fusedce.lm_head.head import LinearHeadFunction, compact_rows, make_head, scatter_rows


def linear_cross_entropy(call, hidden, weight, bias):
    """The op on a checked ``CECall`` with class indices, ``hidden`` (BT, H) -> ``(loss, lse, predicted,
    token_weight)``: the loss reduced (or (BT,) for "none"), (BT,) rows 0 / -1 on ignored rows, token_weight the
    factor of each row's loss (``p_t`` times the token weights; None when neither)."""
    opts, reduction, spec, stats = call.opts, call.reduction, call.head, call.return_stats
    target, ce_weight, token_weights, scales = call.target, call.class_weights, call.token_weights, call.scales
    accum_dtype, batch_invariant = spec.accum_dtype, spec.batch_invariant
    impl = backends.named(call.backend)
    n = hidden.shape[0]
    w, weight_sum = (None, None) if ce_weight is None else (ce_weight.float(), ce_weight.float().sum())
    hidden, target, index = compact_rows(hidden, target, opts.ignore_index)
    if index is not None and token_weights is not None:
        token_weights = token_weights.index_select(0, index)
    kept = hidden.shape[0]
    head = make_head(impl.CHUNK_CE, impl.TILED_CE, spec.method, hidden.shape[0], hidden.shape[1], weight.shape[0],
                     spec.rows, spec.deterministic, hidden.device.type, spec.logits, batch_invariant)
    if batch_invariant:
        hidden, target, token_weights = invariant.pad_rows(hidden, target, opts.ignore_index, token_weights,
                                                           head.invariant_rows(weight.shape[0]))
    if scales is None:
        one = torch.ones((), device=hidden.device)
        scales = MeanScales(one, one)
    needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and any(needs):
        out, lse, predicted, token_weight = LinearHeadFunction.apply(
            hidden, weight, bias, target, head, w, weight_sum, opts, reduction, torch.stack(scales), accum_dtype, stats,
            needs, token_weights)
        token_weight = times(token_weight if opts.use_token_scaling else None, token_weights)
    else:
        with torch.no_grad():
            loss, lse, _lse_lo, predicted, token_weight, _ = head.forward(hidden, weight, bias, target, w,
                                                                          weight_sum, opts, stats)
        token_weight = times(token_weight, token_weights)
        out = reduce(*token_scaled(loss, z_rows(lse, opts), token_weight), reduction, scales, loss.shape)
    if batch_invariant:   # the padding rows dropped (a no-op slice without padding; no traced size test)
        out = out[:kept] if reduction == "none" else out
        lse, predicted = lse[:kept], predicted[:kept]
        token_weight = None if token_weight is None else token_weight[:kept]
    if reduction == "none":
        out = scatter_rows(out, index, n, 0.0)
    if token_weight is not None:
        token_weight = scatter_rows(token_weight, index, n, 0.0)
    return out, scatter_rows(lse, index, n, 0.0), scatter_rows(predicted, index, n, -1), token_weight
