"""megatron-core 0.19's MTP acceptance count without logits: taken from the fused loss's argmax
(docs/megatron.md); real logits go to the stock function unchanged."""
from __future__ import annotations

import torch

from fusedce.integrations.megatron import head

_MARK = "_fusedce_deferred_logits"


def _counts(logits: head.DeferredLogits, labels: torch.Tensor, loss_mask: torch.Tensor):
    predicted = logits.outputs.get("predicted")
    if predicted is None:
        raise RuntimeError("fusedce.patch_megatron: an MTP acceptance count was asked for logits whose loss "
                           "did not keep its predictions (the patched loss runs before the count in 0.19)")
    with torch.no_grad():
        valid = loss_mask.transpose(0, 1).bool()                       # [b, s] -> [s, b], as the stock count
        correct = ((predicted == labels.transpose(0, 1)) & valid).sum().float()
        return correct, valid.sum().float()


def install() -> None:
    """Wrap ``multi_token_prediction._compute_mtp_acceptance_counts`` (once; module docstring)."""
    from megatron.core.transformer import multi_token_prediction as mtp
    stock = mtp._compute_mtp_acceptance_counts
    if getattr(stock, _MARK, False):
        return

    def counts(mtp_logits, mtp_labels, loss_mask, *args, **kwargs):
        if isinstance(mtp_logits, head.DeferredLogits):
            return _counts(mtp_logits, mtp_labels, loss_mask)
        return stock(mtp_logits, mtp_labels, loss_mask, *args, **kwargs)

    setattr(counts, _MARK, True)
    counts.__wrapped__ = stock
    mtp._compute_mtp_acceptance_counts = counts
