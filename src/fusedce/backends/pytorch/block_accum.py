"""The weight and bias gradients of one vocabulary block of the PyTorch tiled loops (``tiled.py``, ``probs_tiled.py``),
summed over every row block in at least fp32 and rounded to ``accum_dtype`` once."""
from __future__ import annotations

from typing import Optional

import torch


class VocabBlockGrads:
    """``(acc_w, acc_b)`` of one vocabulary block ``cols`` of ``grad_w`` / ``grad_b`` (either None):
    ``add(dz, h32)`` per row block (``acc_w += dz.T @ h32``, ``acc_b += sum_rows dz``), ``store()`` once
    after the last row block."""

    def __init__(self, grad_w: Optional[torch.Tensor], grad_b: Optional[torch.Tensor], cols: slice):
        self.grad_w, self.grad_b, self.cols = grad_w, grad_b, cols
        self.acc_w = None if grad_w is None else _wide(grad_w[cols])
        self.acc_b = None if grad_b is None else _wide(grad_b[cols])

    def add(self, dz: torch.Tensor, h32: torch.Tensor) -> None:
        if self.acc_w is not None:
            self.acc_w.addmm_(dz.t().to(self.acc_w.dtype), h32.to(self.acc_w.dtype))
        if self.acc_b is not None:
            self.acc_b += dz.sum(dim=0, dtype=self.acc_b.dtype)

    def store(self) -> None:
        """Round the block's sums into the gradients (nothing to do where they were the slices)."""
        for acc, grad in ((self.acc_w, self.grad_w), (self.acc_b, self.grad_b)):
            if acc is not None and acc.dtype != grad.dtype:
                grad[self.cols] = acc


def _wide(block: torch.Tensor) -> torch.Tensor:
    """The slice itself when its dtype has at least fp32's precision, else a zeroed fp32 copy of its shape
    (the slices start at zero: every vocabulary block is visited by one thread, once)."""
    if torch.finfo(block.dtype).bits >= 32:
        return block
    return torch.zeros(block.shape, dtype=torch.float32, device=block.device)
