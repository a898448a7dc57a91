"""Reductions shared by ``cross_entropy`` and ``linear_cross_entropy``: the mean denominator, the
reduced loss and the stats. Everything stays on the device (no host sync)."""
from __future__ import annotations

from typing import Optional

import torch

from .types import CrossEntropyOutput, LossOptions


def mean_denominator(target: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int,
                     num_items_in_batch) -> torch.Tensor:
    """``D`` of ``reduction="mean"`` as a 0-dim fp32 device tensor.

    ``num_items_in_batch`` (int or 0-dim tensor) when given, else ``sum(w[t])`` over non-ignored rows
    (their count without class weights). Never syncs with the host.
    """
    device = target.device
    if isinstance(num_items_in_batch, torch.Tensor):
        # A device tensor stays on the device (a CPU tensor with CUDA data is one small H2D copy).
        return num_items_in_batch.to(device=device, dtype=torch.float32).reshape(())
    if num_items_in_batch is not None:
        # A Python number becomes a fill kernel, not an H2D copy of a CPU scalar (a pageable copy
        # synchronizes the stream and cannot be captured in a CUDA graph).
        return torch.full((), float(num_items_in_batch), dtype=torch.float32, device=device)
    valid = target != ignore_index
    if weight is None:
        return valid.sum().to(torch.float32)
    safe = torch.where(valid & (target >= 0) & (target < weight.shape[0]), target, 0).long()
    return torch.where(valid, weight.float()[safe], 0.0).sum()


def mean_scale(denominator: torch.Tensor) -> torch.Tensor:
    """``1 / D``, or 0 when ``D == 0`` (the loss is then 0.0 and the gradient all zeros, not NaN)."""
    nonzero = denominator != 0
    return torch.where(nonzero, 1.0 / torch.where(nonzero, denominator, 1.0), 0.0)


def reduce(per_row: torch.Tensor, reduction: str, scale: Optional[torch.Tensor], shape) -> torch.Tensor:
    """Apply ``reduction`` to a (BT,) fp32 per-row tensor; ``scale`` is ``mean_scale`` for "mean"."""
    if reduction == "none":
        return per_row.reshape(shape)
    total = per_row.sum()
    return total * scale if reduction == "mean" else total


def stats(loss: torch.Tensor, lse: torch.Tensor, predicted: torch.Tensor, target: torch.Tensor,
          opts: LossOptions, reduction: str, scale: Optional[torch.Tensor], shape) -> CrossEntropyOutput:
    """Build ``CrossEntropyOutput`` from the per-row lse and argmax (BT,) and the reduced ``loss``."""
    valid = target != opts.ignore_index
    z_rows = torch.where(valid, opts.lse_square_scale * lse.detach() * lse.detach(), 0.0)
    z_loss = reduce(z_rows, reduction, scale, shape)
    correct = (valid & (predicted == target)).to(torch.float32)
    if reduction == "none":
        accuracy = correct.reshape(shape)
    else:
        accuracy = correct.sum() / valid.sum().clamp_min(1).to(torch.float32)
    return CrossEntropyOutput(loss, z_loss, lse.detach().reshape(shape), accuracy,
                              predicted.reshape(shape))
