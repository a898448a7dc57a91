"""Reduction and stats of the vocab-parallel losses: ``fusedce.core.reduction`` with the mean denominator
taken from the exchanged target weights (``w_t`` lives on the rank that owns ``t``). No collective, no
host sync."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core import reduction as red
from fusedce.core.options import LossOptions


def finish(loss_rows: torch.Tensor, lse: torch.Tensor, predicted: torch.Tensor,
           target_weight: Optional[torch.Tensor], target: torch.Tensor, opts: LossOptions,
           reduction: str, num_items_in_batch, return_stats: bool, shape,
           token_weight: Optional[torch.Tensor] = None):
    """Reduce the (n,) per-row cross-entropy and lse like ``fusedce.cross_entropy`` does (the z-loss from the global
    lse, the mean ``sum(ce_row) / D + sum(z_row) / N``)."""
    scales = None
    if reduction == "mean":
        if target_weight is not None:
            target_weight = torch.where(opts.kept(target), target_weight, 0.0)
        scales = red.mean_scales(target, target_weight, opts.ignore_index, num_items_in_batch)
    return red.loss_and_stats(loss_rows, lse, predicted, target, opts, reduction, scales, shape, return_stats,
                              token_weight)
