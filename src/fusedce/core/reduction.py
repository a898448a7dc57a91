"""Reductions shared by every op (the mean's denominators, the z-loss, the stats), all on the device."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from fusedce.core.types import CrossEntropyOutput
from fusedce.core.options import LossOptions


class MeanScales(NamedTuple):
    """``1 / D`` and ``1 / N`` of ``reduction="mean"`` as 0-dim fp32 device tensors (0 where the
    denominator is 0: the loss is then 0.0 and the gradient all zeros, not NaN)."""

    ce: torch.Tensor
    z: torch.Tensor


def mean_scale(denominator: torch.Tensor) -> torch.Tensor:
    """``1 / D``, or 0 when ``D == 0``."""
    nonzero = denominator != 0
    return torch.where(nonzero, 1.0 / torch.where(nonzero, denominator, 1.0), 0.0)


def _given(num_items_in_batch, device: torch.device) -> torch.Tensor:
    if isinstance(num_items_in_batch, torch.Tensor):
        # A device tensor stays on the device (a CPU tensor with CUDA data is one small H2D copy).
        return num_items_in_batch.to(device=device, dtype=torch.float32).reshape(())
    # A Python number becomes a fill kernel, not an H2D copy of a CPU scalar (a pageable copy
    # synchronizes the stream and cannot be captured in a CUDA graph).
    return torch.full((), float(num_items_in_batch), dtype=torch.float32, device=device)


def token_mean_scale(target: Optional[torch.Tensor], n_rows: int, ignore_index: int, num_items_in_batch,
                     device: torch.device) -> torch.Tensor:
    """The distillation losses' mean: 0-dim fp32 ``1 / D``, ``D`` = ``num_items_in_batch``, else the kept tokens,
    else ``n_rows``; 0 when ``D == 0``."""
    if num_items_in_batch is not None:
        return mean_scale(_given(num_items_in_batch, device))
    if target is None:
        return mean_scale(torch.full((), float(n_rows), dtype=torch.float32, device=device))
    return mean_scale((target != ignore_index).sum().to(torch.float32))


def target_weights(target: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int):
    """Per-row ``w[t]`` (fp32 (BT,), 0 on ignored rows), or None without class weights; never indexes
    with ``ignore_index`` or an out-of-range target."""
    if weight is None:
        return None
    valid = target != ignore_index
    safe = torch.where(valid & (target >= 0) & (target < weight.shape[0]), target, 0).long()
    return torch.where(valid, weight.float()[safe], 0.0)


def mean_scales(target: torch.Tensor, target_weight: Optional[torch.Tensor], ignore_index: int,
                num_items_in_batch) -> MeanScales:
    """The mean's ``D`` (``num_items_in_batch``, else ``sum(target_weight)``, else the count) and ``N``
    (``num_items_in_batch``, else the count of kept rows)."""
    if num_items_in_batch is not None:
        scale = mean_scale(_given(num_items_in_batch, target.device))
        return MeanScales(scale, scale)
    count = mean_scale((target != ignore_index).sum().to(torch.float32))
    if target_weight is None:
        return MeanScales(count, count)
    return MeanScales(mean_scale(target_weight.sum()), count)


def row_count_scales(n_rows: int, device: torch.device, num_items_in_batch) -> MeanScales:
    """The mean's scales for probability targets: ``1 / num_items_in_batch``, else ``1 / n_rows`` (as torch)."""
    given = num_items_in_batch is not None
    scale = mean_scale(_given(num_items_in_batch if given else n_rows, device))
    return MeanScales(scale, scale)


def z_rows(lse: torch.Tensor, opts: LossOptions) -> Optional[torch.Tensor]:
    """Per-row z-loss ``lse_square_scale * lse**2`` (0 on ignored rows), or None when the scale is 0."""
    if opts.lse_square_scale == 0.0:
        return None
    return opts.lse_square_scale * lse * lse


def reduce(ce_rows: torch.Tensor, z: Optional[torch.Tensor], reduction: str,
           scales: Optional[MeanScales], shape) -> torch.Tensor:
    """The loss from the (BT,) fp32 per-row cross-entropy and z-loss; ``scales`` for "mean"."""
    if reduction == "none":
        return (ce_rows if z is None else ce_rows + z).reshape(shape)
    if reduction == "sum":
        return ce_rows.sum() if z is None else ce_rows.sum() + z.sum()
    assert scales is not None, "reduction='mean' needs its scales"
    total = ce_rows.sum() * scales.ce
    return total if z is None else total + z.sum() * scales.z


def token_scaled(ce_rows: torch.Tensor, z: Optional[torch.Tensor],
                 token_weight: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Each row's cross-entropy and z-loss times the detached ``token_weight`` (``times``, DFT's ``p_t``)."""
    if token_weight is None:
        return ce_rows, z
    token_weight = token_weight.detach()
    return ce_rows * token_weight, None if z is None else z * token_weight


def row_token_weights(token_weights: Optional[torch.Tensor], target: torch.Tensor,
                      ignore_index: int) -> Optional[torch.Tensor]:
    """The user's ``token_weights`` as a detached (BT,) fp32 row factor, 0 on ignored rows; None stays None."""
    if token_weights is None:
        return None
    return torch.where(target.reshape(-1) != ignore_index, token_weights.detach().reshape(-1).float(), 0.0)


def times(token_weight: Optional[torch.Tensor], token_weights: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The per-row loss factor: ``use_token_scaling``'s ``p_t`` times the user's ``token_weights`` (either None)."""
    if token_weights is None:
        return token_weight
    return token_weights if token_weight is None else token_weight * token_weights


def loss_and_stats(ce_rows: torch.Tensor, lse: torch.Tensor, predicted: torch.Tensor,
                   target: torch.Tensor, opts: LossOptions, reduction: str, scales: Optional[MeanScales],
                   shape, return_stats: bool, token_weight: Optional[torch.Tensor] = None):
    """The public result from the per-row cross-entropy and lse ((BT,) fp32) and the row factor (``times``):
    the reduced loss, or ``CrossEntropyOutput`` with ``return_stats``."""
    loss = reduce(*token_scaled(ce_rows, z_rows(lse, opts), token_weight), reduction, scales, shape)
    if not return_stats:
        return loss
    return stats(loss, lse, predicted, target, opts, reduction, scales, shape, token_weight)


def stats(loss: torch.Tensor, lse: torch.Tensor, predicted: torch.Tensor, target: torch.Tensor,
          opts: LossOptions, reduction: str, scales: Optional[MeanScales], shape,
          token_weight: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None) -> CrossEntropyOutput:
    """``CrossEntropyOutput`` from the per-row lse and argmax and the reduced ``loss``."""
    valid = opts.kept(target) if valid is None else valid
    lse = lse.detach()
    z = token_scaled(lse, z_rows(lse, opts), token_weight)[1]
    z_loss = reduce(torch.zeros_like(lse) if z is None else z, None, reduction,
                    None if scales is None else MeanScales(scales.z, scales.z), shape)
    correct = (valid & (predicted == target)).to(torch.float32)
    if reduction == "none":
        accuracy = correct.reshape(shape)
    else:
        accuracy = correct.sum() / valid.sum().clamp_min(1).to(torch.float32)
    return CrossEntropyOutput(loss, z_loss, lse.reshape(shape), accuracy, predicted.reshape(shape))
