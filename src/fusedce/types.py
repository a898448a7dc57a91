"""Plain data types shared by every layer: the loss options and the stats output."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import List, NamedTuple, Optional, Tuple

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


class TokenLogProbs(NamedTuple):
    """What ``token_log_probs`` / ``linear_token_log_probs`` return with ``return_entropy=True``: fp32
    tensors of ``target.shape``, ``log_probs = log softmax(q)[t]`` and ``entropy = -sum_c softmax(q)_c
    log softmax(q)_c`` (``q`` the logits after softcap and temperature), both 0 on ignored rows and
    both differentiable."""

    log_probs: torch.Tensor
    entropy: torch.Tensor


@dataclass(frozen=True)
class LossOptions:
    """The per-row loss options, already validated (``validation.loss_options``): the one description
    of them. Every form the layers below need is made here, and only here:

    - ``op_args()`` / ``from_op_args()``: the torch custom ops' arguments, ``(ignore_index: int,
      scalars: list[float])``, and back (a custom op cannot take this dataclass; a list keeps the ops'
      schemas unchanged when an option is added);
    - ``kernel_scalars()``: the Triton kernels' runtime scalars (fp32; changing them does not
      recompile), in the kernels' argument order after the pointers, sizes and strides;
    - ``kernel_flags()``: the constexpr flags that select code paths.

    Semantics (per row, in fp32): ``x`` the logits, ``z = softcap * tanh(logit_scale * x / softcap)``
    (``z = logit_scale * x`` without softcap), then the cross-entropy of ``z`` with ``label_smoothing``,
    plus the z-loss ``lse_square_scale * lse(z)**2``; with ``use_token_scaling`` the row's whole loss is
    multiplied by ``p_t = softmax(z)[t]``, detached.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: Optional[float] = None
    logit_scale: float = 1.0
    use_token_scaling: bool = False

    def op_args(self) -> Tuple[int, List[float]]:
        """``(ignore_index, scalars)``: every other field as a float, in field order (``softcap=None``
        travels as 0.0, which no valid softcap is; booleans as 0.0 / 1.0)."""
        return self.ignore_index, [float(getattr(self, f.name) or 0.0) for f in fields(self)[1:]]

    @classmethod
    def from_op_args(cls, ignore_index: int, scalars: List[float]) -> "LossOptions":
        """Inverse of ``op_args``."""
        values = dict(zip((f.name for f in fields(cls)[1:]), scalars))
        values["softcap"] = values["softcap"] or None
        values["use_token_scaling"] = bool(values["use_token_scaling"])
        return cls(ignore_index=ignore_index, **values)

    def kernel_scalars(self) -> tuple:
        """``(ignore_index, label_smoothing, softcap, logit_scale)``: softcap 1.0 when unused. The
        z-loss and token scaling are not among them: both act on the per-row results (the lse and the
        loss), outside the kernels."""
        return (self.ignore_index, self.label_smoothing, 1.0 if self.softcap is None else self.softcap,
                self.logit_scale)

    def kept(self, target: torch.Tensor) -> torch.Tensor:
        """bool of ``target``'s shape: the rows that count (target != ignore_index). The one place of
        that test outside the kernels (which test ``target != ignore_index`` per program)."""
        return target != self.ignore_index

    def kernel_flags(self) -> dict:
        """The constexpr flags the options select (class weights add ``HAS_WEIGHT`` at launch)."""
        return {"HAS_SMOOTHING": self.label_smoothing > 0.0, "HAS_SOFTCAP": self.softcap is not None}


class SliceStats(NamedTuple):
    """Partial row statistics of a vocabulary slice (the backends' ``slice_stats``). Per row (n,):
    ``xmax`` fp32 raw max, ``argmax`` int64 global index (lowest on ties), ``zmax`` fp32 max of z (-inf
    where the slice is all -inf), ``sumexp`` fp32 ``sum exp(z - zmax)`` (0 there), ``target_logit`` fp32
    z_t where this slice holds the target (else 0), ``zsum`` fp32 ``sum w_c z_c`` (None without
    smoothing)."""

    xmax: torch.Tensor
    argmax: torch.Tensor
    zmax: torch.Tensor
    sumexp: torch.Tensor
    target_logit: torch.Tensor
    zsum: Optional[torch.Tensor]
