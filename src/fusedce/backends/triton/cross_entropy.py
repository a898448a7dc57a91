"""Autograd for the Triton cross-entropy custom ops, and the backend interface ``cross_entropy_rows``."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.options import LossOptions
from ..op_autograd import register_rows_autograd
from . import custom_ops

register_rows_autograd("fusedce")   # the formula: backends/op_autograd.py


def _weights(weight: Optional[torch.Tensor]):
    if weight is None:
        return None, None
    return weight.contiguous(), weight.float().sum().reshape(1)


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                       opts: LossOptions, inplace_backward: bool = False, stats: bool = True):
    """Per-row loss of ``logits`` ((BT, V), last-dim stride 1) against ``target`` ((BT,)).

    Returns ``(loss (BT,) fp32, lse (BT,) fp32, lse_lo (BT,) fp32, predicted (BT,) int64 or empty if not
    stats)``: the cross-entropy without z-loss and the lse (0 on ignored rows), both differentiable
    w.r.t. ``logits``, and lse's rounding error (no gradient).
    With ``inplace_backward`` the backward pass writes the gradient into ``logits``' storage (a second
    backward then raises ``RuntimeError``).
    """
    w, weight_sum = _weights(weight)
    return custom_ops.forward(logits, target, w, weight_sum, opts, stats, inplace_backward)
