"""Plain data types shared by every layer: the loss options and the stats output."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch


class CrossEntropyOutput(NamedTuple):
    """What ``cross_entropy(..., return_stats=True)`` and ``linear_cross_entropy`` return.

    - ``loss``: float32, reduced as asked (``"none"``: shape ``target.shape``); the only field with a gradient.
    - ``z_loss``: float32, the ``lse_square_scale * lse**2`` part of ``loss`` alone, same reduction
      (``"mean"``: divided by N, the count of non-ignored rows or ``num_items_in_batch``).
    - ``lse``: float32 ``target.shape``, per-row log-sum-exp of the (softcapped) logits; 0 on ignored
      rows (never computed), in every op.
    - ``token_accuracy``: float32; fraction of non-ignored rows whose argmax (lowest index on ties)
      equals the target, 0.0 when no row counts; per-row 0/1 for ``reduction="none"`` (0 on ignored rows).
    - ``predicted_tokens``: int64 ``target.shape``, argmax of the logits per row, -1 on ignored rows.
    """

    loss: torch.Tensor
    z_loss: torch.Tensor
    lse: torch.Tensor
    token_accuracy: torch.Tensor
    predicted_tokens: torch.Tensor


@dataclass(frozen=True)
class LossOptions:
    """Per-row loss hyper-parameters, already validated. Scalars are Python floats (fp32 in kernels)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: Optional[float] = None
