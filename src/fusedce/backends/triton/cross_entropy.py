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
    """Per-row ``(loss, lse, lse_lo, predicted)`` of ``logits`` (BT, V) against ``target`` (BT,): fp32 (BT,) each
    (0 on ignored rows; loss and lse differentiable), predicted int64 or empty without ``stats``;
    ``inplace_backward``: the gradient written into ``logits``' storage."""
    w, weight_sum = _weights(weight)
    return custom_ops.forward(logits, target, w, weight_sum, opts, stats, inplace_backward)
