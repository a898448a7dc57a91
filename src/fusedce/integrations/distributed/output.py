"""Reduction and stats of the vocab-parallel losses: ``fusedce.reduction`` with the mean denominator
taken from the exchanged target weights (``w_t`` lives on the rank that owns ``t``). No collective, no
host sync."""
from __future__ import annotations

from typing import Optional

import torch

from ... import reduction as red
from ...types import LossOptions


def finish(loss_rows: torch.Tensor, lse: torch.Tensor, predicted: torch.Tensor,
           target_weight: Optional[torch.Tensor], target: torch.Tensor, opts: LossOptions,
           reduction: str, num_items_in_batch, return_stats: bool, shape):
    """Reduce the (n,) per-row loss like ``fusedce.cross_entropy`` does.

    ``D`` of ``"mean"``: ``num_items_in_batch`` if given, else ``sum(w_t)`` over non-ignored rows with
    ``w_t`` the global target weight from the exchange (the count of non-ignored rows without class
    weights); ``D == 0`` gives loss 0.0 and a zero gradient.
    """
    scale = None
    if reduction == "mean":
        if target_weight is None or num_items_in_batch is not None:
            denominator = red.mean_denominator(target, None, opts.ignore_index, num_items_in_batch)
        else:
            denominator = torch.where(target != opts.ignore_index, target_weight, 0.0).sum()
        scale = red.mean_scale(denominator)
    loss = red.reduce(loss_rows, reduction, scale, shape)
    if not return_stats:
        return loss
    return red.stats(loss, lse, predicted, target, opts, reduction, scale, shape)
