"""The Hugging Face patch's ``token_weights`` forward keyword: per-token loss weights given in the
labels' layout, turned into the flat per-row weights of ``linear_cross_entropy``'s target."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def flat_token_weights(token_weights, labels: torch.Tensor, given_shifted: bool, device):
    """``token_weights`` ((B, T) float or None) as ``(B * T,)`` on ``device``, shifted like the labels (the last
    position 0), or as given with ``given_shifted``."""
    if token_weights is None:
        return None
    if not isinstance(token_weights, torch.Tensor) or not token_weights.is_floating_point():
        kind = token_weights.dtype if isinstance(token_weights, torch.Tensor) else type(token_weights).__name__
        raise TypeError(f"token_weights must be a floating-point tensor of the labels' shape, got {kind}")
    if tuple(token_weights.shape) != tuple(labels.shape):
        which = "shift_labels" if given_shifted else "labels"
        raise ValueError(f"token_weights shape {tuple(token_weights.shape)} must equal the {which}' "
                         f"{tuple(labels.shape)}")
    if not given_shifted:
        token_weights = F.pad(token_weights, (0, 1))[..., 1:]
    return token_weights.to(device).reshape(-1)
