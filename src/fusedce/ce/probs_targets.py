"""``cross_entropy`` with probability targets after ``ce/checks.py`` (``F.cross_entropy``'s semantics:
``docs/contract.md``, "Probability targets"); the row math is the backends' ``probs_cross_entropy_rows``."""
from __future__ import annotations

import torch

from fusedce.core import reduction as red


def cross_entropy(call, impl, rows: torch.Tensor):
    """The op on a checked ``CECall`` with probability targets, ``rows`` the logits (BT, V) and ``impl`` the
    backend: the fp32 loss, or ``CrossEntropyOutput`` (every row counted)."""
    q, opts = call.target, call.opts
    ce_rows, lse, _lse_lo, predicted = impl.probs_cross_entropy_rows(rows, q, call.class_weights, opts,
                                                                    call.inplace_backward, call.return_stats)
    loss = red.reduce(*red.token_scaled(ce_rows, red.z_rows(lse, opts), call.token_weights), call.reduction,
                      call.scales, call.lead)
    if not call.return_stats:
        return loss
    expected = q.argmax(dim=1)
    return red.stats(loss, lse, predicted, expected, opts, call.reduction, call.scales, call.lead,
                     call.token_weights, valid=torch.ones_like(expected, dtype=torch.bool))
