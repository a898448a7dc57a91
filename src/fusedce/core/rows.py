"""The (BT, V) row view of (..., V) logits that every logits op hands its backend."""
from __future__ import annotations

import torch


def rows_view(logits: torch.Tensor, inplace_backward: bool) -> torch.Tensor:
    """(..., V) -> (BT, V) with last-dim stride 1; copies once only when no such view exists, or when
    an in-place backward would write several rows into one memory location (rows closer than V
    elements apart: expanded logits, or an ``as_strided`` view whose rows overlap)."""
    flat = logits.reshape(-1, logits.shape[-1])
    overlapping = inplace_backward and flat.shape[0] > 1 and flat.stride(0) < flat.shape[-1]
    if overlapping or (flat.stride(-1) != 1 and flat.shape[-1] > 1):
        return flat.contiguous()
    return flat
