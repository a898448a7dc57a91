"""``cross_entropy`` with probability ("soft") targets after ``ce/checks.py`` (backend call, reduction,
stats); ``functional.cross_entropy`` dispatches here when its ``target`` is a floating-point tensor.

Semantics (``F.cross_entropy`` with class-probability targets, on the classes in the LAST dimension):
per row ``loss = -sum_c w_c q'_c log softmax(z)_c`` with ``q' = (1 - eps) q + eps / V``; the z-loss,
logit scale, softcap and ``token_weights`` as for class indices; no row is ignored (``ignore_index`` does
not apply); ``"mean"`` divides the cross-entropy and the z-loss by the number of rows (or
``num_items_in_batch``), whatever the class weights, as torch does. The row math is the backends'
``soft_cross_entropy_rows`` (``backends/pytorch/soft_targets.py``, ``backends/triton/soft_targets.py``).
"""
from __future__ import annotations

import torch

from fusedce.core import reduction as red


def cross_entropy(call, impl, rows: torch.Tensor):
    """The op on a checked ``CECall`` (``ce/checks.py``): ``rows`` the logits as (BT, V) with last-dim stride 1,
    ``impl`` the backend package. Returns the fp32 loss, or ``CrossEntropyOutput`` with ``return_stats``:
    ``lse`` per row, ``predicted_tokens`` the argmax of the logits, ``token_accuracy`` the fraction of rows
    whose argmax equals the argmax of the target (lowest index on ties for both; one more read of the
    target), every row counted."""
    q, opts = call.target, call.opts
    ce_rows, lse, _lse_lo, predicted = impl.soft_cross_entropy_rows(rows, q, call.class_weights, opts,
                                                                    call.inplace_backward, call.return_stats)
    loss = red.reduce(*red.token_scaled(ce_rows, red.z_rows(lse, opts), call.token_weights), call.reduction,
                      call.scales, call.lead)
    if not call.return_stats:
        return loss
    expected = q.argmax(dim=1)
    return red.stats(loss, lse, predicted, expected, opts, call.reduction, call.scales, call.lead,
                     call.token_weights, valid=torch.ones_like(expected, dtype=torch.bool))
