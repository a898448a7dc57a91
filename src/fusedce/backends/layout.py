"""Memory layout of the kernel backends' custom-op inputs (``triton``, ``cute``): their kernels index the
last dimension with unit stride and the per-row vectors contiguously."""
from __future__ import annotations

from typing import Optional

import torch


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension has stride 1 (or at most one element), else a contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def opt_contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """None, or ``t.contiguous()``."""
    return None if t is None else t.contiguous()
