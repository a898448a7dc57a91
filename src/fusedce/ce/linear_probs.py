"""``linear_cross_entropy`` with probability targets after ``ce/checks.py``: the soft heads (``lm_head/probs_loop.py``)
through the heads' autograd skeleton (``docs/internals.md``, "``ce/linear_probs.py``")."""
from __future__ import annotations

import torch

from fusedce import backends
from fusedce.core import reduction as red
from fusedce.lm_head.head import LinearHeadFunction
from fusedce.lm_head.probs_loop import make_probs_head


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
    head = make_probs_head(backends.named(call.backend), spec.method, n, hidden.shape[-1], weight.shape[0], spec.rows,
                          hidden.device.type, spec.logits)
    needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and any(needs):
        loss, lse, predicted, _ = LinearHeadFunction.apply(hidden, weight, bias, q, head, w, None, opts, reduction,
                                                           torch.stack(scales), spec.accum_dtype, call.return_stats,
                                                           needs, factor)
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
