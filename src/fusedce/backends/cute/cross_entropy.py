"""Autograd for the CuTe cross-entropy custom ops, and the backend interface ``cross_entropy_rows``."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.options import LossOptions
from ..op_autograd import register_rows_autograd
from . import custom_ops  # noqa: F401 - registers the fusedce_cute ops

register_rows_autograd("fusedce_cute")   # the formula: backends/op_autograd.py


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                       opts: LossOptions, inplace_backward: bool = False, stats: bool = True):
    """Per-row loss of ``logits`` ((BT, V), CUDA) against ``target`` ((BT,)): ``(loss, lse, lse_lo,
    predicted)`` as the Triton backend's (``backends/__init__.py``)."""
    weight_sum = None if weight is None else weight.float().sum().reshape(1)
    return torch.ops.fusedce_cute.ce_forward(logits, target, weight, weight_sum, *opts.op_args(), stats,
                                             inplace_backward)
