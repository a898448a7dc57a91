"""``nn.Module`` wrappers with the same argument order and semantics as the functions."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import backends, validation as val
from .functional import cross_entropy, linear_cross_entropy


def _check_options(name, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
                   backend, logit_scale, use_token_scaling):
    """The construction-time checks shared by both modules: the same errors as the functions raise."""
    val.loss_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap, logit_scale,
                     use_token_scaling)
    val.check_class_weights(name, weight)
    if backend is not None:   # None reads $FUSEDCE_BACKEND at each call
        backends.check_name(backend)


class CrossEntropyLoss(nn.Module):
    """Module form of :func:`fusedce.cross_entropy`; ``weight`` is registered as a buffer.

    ``forward(logits (..., V), target (...), num_items_in_batch=None)``; see ``cross_entropy`` for
    shapes, dtypes, the in-place option and errors.

    ``logit_scale`` and ``use_token_scaling`` (keyword-only: added after the contract's positional
    options) are as in ``cross_entropy``.

    The options are checked at construction, with the errors of ``cross_entropy``: ``ValueError`` for
    a bad ``reduction``, ``label_smoothing`` outside [0, 1], ``softcap <= 0``, ``logit_scale`` not a
    positive normal fp32 number, a non-finite number, an ``ignore_index`` outside int64, a ``weight``
    that is not 1-D or an unknown ``backend`` name; ``TypeError`` for a non-integer ``ignore_index`` (a
    float, a bool), a non-number option, a non-bool flag or a ``weight`` that is not a floating-point
    tensor. Shapes, devices, ``"triton"`` without CUDA or the interpreter and ``"cute"`` without CUDA or
    its extra (``RuntimeError``) are checked at each call.
    """

    def __init__(self, weight: Optional[torch.Tensor] = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                 softcap: Optional[float] = None, inplace_backward: bool = False, return_stats: bool = False,
                 backend: Optional[str] = None, *, logit_scale: float = 1.0, use_token_scaling: bool = False):
        _check_options("weight", weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
                       backend, logit_scale, use_token_scaling)
        val.check_flag("inplace_backward", inplace_backward)
        val.check_flag("return_stats", return_stats)
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.lse_square_scale, self.softcap = label_smoothing, lse_square_scale, softcap
        self.inplace_backward, self.return_stats, self.backend = inplace_backward, return_stats, backend
        self.logit_scale, self.use_token_scaling = logit_scale, use_token_scaling

    def forward(self, logits: torch.Tensor, target: torch.Tensor, num_items_in_batch=None):
        return cross_entropy(
            logits, target, self.weight, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, lse_square_scale=self.lse_square_scale,
            softcap=self.softcap, logit_scale=self.logit_scale, use_token_scaling=self.use_token_scaling,
            num_items_in_batch=num_items_in_batch,
            inplace_backward=self.inplace_backward, return_stats=self.return_stats, backend=self.backend)


class LinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`fusedce.linear_cross_entropy` (the LM head's weight is passed to forward).

    ``forward(hidden (..., H), weight (V, H), target (...), bias=None, num_items_in_batch=None)``; see
    ``linear_cross_entropy`` for shapes, dtypes, chunking and errors. ``ce_weight`` is a buffer.

    The options are checked at construction, as in :class:`CrossEntropyLoss` (``ce_weight`` for
    ``weight``), plus ``chunk_size`` (``TypeError`` unless an integer or None, ``ValueError`` when < 1),
    ``method`` (keyword-only; ``ValueError`` unless "auto" / "chunked" / "tiled", or with a
    ``chunk_size`` and "tiled") and ``accum_dtype`` (``TypeError`` unless a floating-point
    ``torch.dtype``).
    """

    def __init__(self, ce_weight: Optional[torch.Tensor] = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                 softcap: Optional[float] = None, return_stats: bool = False, backend: Optional[str] = None,
                 chunk_size: Optional[int] = None, accum_dtype: torch.dtype = torch.float32, *,
                 logit_scale: float = 1.0, use_token_scaling: bool = False, method: str = "auto"):
        _check_options("ce_weight", ce_weight, ignore_index, reduction, label_smoothing, lse_square_scale,
                       softcap, backend, logit_scale, use_token_scaling)
        val.check_chunk_size(chunk_size)
        val.check_method(method, chunk_size)
        val.check_flag("return_stats", return_stats)
        val.check_accum_dtype(accum_dtype)
        super().__init__()
        self.register_buffer("ce_weight", ce_weight)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.lse_square_scale, self.softcap = label_smoothing, lse_square_scale, softcap
        self.return_stats, self.backend = return_stats, backend
        self.chunk_size, self.accum_dtype, self.method = chunk_size, accum_dtype, method
        self.logit_scale, self.use_token_scaling = logit_scale, use_token_scaling

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: Optional[torch.Tensor] = None, num_items_in_batch=None):
        return linear_cross_entropy(
            hidden, weight, target, bias, ce_weight=self.ce_weight, ignore_index=self.ignore_index,
            reduction=self.reduction, label_smoothing=self.label_smoothing,
            lse_square_scale=self.lse_square_scale, softcap=self.softcap, logit_scale=self.logit_scale,
            use_token_scaling=self.use_token_scaling, num_items_in_batch=num_items_in_batch,
            chunk_size=self.chunk_size, method=self.method,
            accum_dtype=self.accum_dtype, return_stats=self.return_stats, backend=self.backend)
