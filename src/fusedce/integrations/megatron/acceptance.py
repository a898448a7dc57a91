"""megatron-core 0.19's MTP acceptance count without logits: ``process_mtp_loss`` counts, on every training
step, the positions where each MTP head's argmax over its ``[s, b, V/TP]`` logits equals the label
(``_compute_mtp_acceptance_counts``: a vocabulary-parallel argmax). For a patched model those logits are
``head.DeferredLogits``; its loss already found each token's global argmax (``return_stats``'s
``predicted_tokens``, ties to the lowest index as ``torch.argmax``), so the count is taken from that.

``install`` wraps the module function once, process-wide; the wrapper hands every call whose logits are
real tensors (an unpatched model) to the stock function unchanged.
"""
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
