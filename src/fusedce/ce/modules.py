"""``nn.Module`` wrappers with the same argument order and semantics as the functions."""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from fusedce import backends
from fusedce.core import validation as val
from fusedce.core.options import check_accum_dtype, check_chunk_size, check_flag, deterministic_mode, loss_options
from fusedce.lm_head import invariant
from fusedce.lm_head.head import check_logits_dtype, check_method
from fusedce.ce.functional import cross_entropy, linear_cross_entropy
from fusedce.core.options.signatures import with_loss_options
from fusedce.core.options import LOSS_OPTION_NAMES, LossOptionValues

if TYPE_CHECKING:
    from typing_extensions import Unpack


def _set_options(module: nn.Module, name: str, weight, reduction, backend, options: dict) -> None:
    """The construction-time checks shared by both modules (the errors the functions raise), then
    every loss option as an attribute of ``module`` (checked, normalized; changing one later is seen
    by the next forward, as in ``torch.nn.CrossEntropyLoss``)."""
    checked = loss_options(reduction, **options)
    val.check_class_weights(name, weight)
    if backend is not None:   # None reads $FUSEDCE_BACKEND at each call
        backends.check_name(backend)
    for name in LOSS_OPTION_NAMES:
        setattr(module, name, getattr(checked, name))


def _options(module: nn.Module) -> dict:
    """The loss options of ``module``, as keywords of the functions."""
    return {name: getattr(module, name) for name in LOSS_OPTION_NAMES}


def _extra_repr(module: nn.Module, *names: str) -> str:
    """``repr``'s inside: ``reduction`` and every other option that differs from its default."""
    defaults = {n: p.default for n, p in inspect.signature(type(module)).parameters.items()}
    shown = [f"reduction={module.reduction!r}"]
    for name in (*LOSS_OPTION_NAMES, *names):
        value = getattr(module, name)
        if name in defaults and value != defaults[name]:
            shown.append(f"{name}={value!r}")
    return ", ".join(shown)


@with_loss_options
class CrossEntropyLoss(nn.Module):
    """Module form of :func:`fusedce.cross_entropy`: ``weight`` a buffer, every option an attribute.

    ``forward(logits (..., V), target (...), num_items_in_batch=None, *, token_weights=None)``. The options are
    checked at construction with ``cross_entropy``'s errors; shapes, devices and the backend's availability
    at each call (``docs/contract.md``, "Modules").
    """

    def __init__(self, weight: Optional[torch.Tensor] = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                 softcap: Optional[float] = None, inplace_backward: bool = False, return_stats: bool = False,
                 backend: Optional[str] = None, *, batch_invariant: bool = False,
                 **options: Unpack[LossOptionValues]):
        if isinstance(ignore_index, bool):   # torch.nn.CrossEntropyLoss(weight, size_average, ...) positionally
            raise TypeError(f"ignore_index must be an integer, got the bool {ignore_index!r}: the second positional "
                            "argument here is ignore_index; torch's deprecated size_average / reduce are not taken "
                            "(pass reduction= by keyword)")
        check_flag("inplace_backward", inplace_backward)
        check_flag("return_stats", return_stats)
        invariant.check(batch_invariant)
        super().__init__()
        _set_options(self, "weight", weight, reduction, backend,
                     dict(options, ignore_index=ignore_index, label_smoothing=label_smoothing,
                          lse_square_scale=lse_square_scale, softcap=softcap))
        self.register_buffer("weight", weight)
        self.reduction, self.inplace_backward, self.return_stats, self.backend = (
            reduction, inplace_backward, return_stats, backend)
        self.batch_invariant = batch_invariant

    def extra_repr(self) -> str:
        return _extra_repr(self, "inplace_backward", "return_stats", "backend", "batch_invariant")

    def forward(self, logits: torch.Tensor, target: torch.Tensor, num_items_in_batch=None, *,
                token_weights: Optional[torch.Tensor] = None):
        return cross_entropy(logits, target, self.weight, reduction=self.reduction,
                             num_items_in_batch=num_items_in_batch, inplace_backward=self.inplace_backward,
                             return_stats=self.return_stats, backend=self.backend, token_weights=token_weights,
                             batch_invariant=self.batch_invariant, **_options(self))


@with_loss_options
class LinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`fusedce.linear_cross_entropy` (the LM head's weight is passed to ``forward``):
    ``ce_weight`` a buffer, every option an attribute.

    ``forward(hidden (..., H), weight (V, H), target (...), bias=None, num_items_in_batch=None, *,
    token_weights=None)``. The options are checked at construction with ``linear_cross_entropy``'s errors
    (``docs/contract.md``, "Modules").
    """

    def __init__(self, ce_weight: Optional[torch.Tensor] = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                 softcap: Optional[float] = None, return_stats: bool = False, backend: Optional[str] = None,
                 chunk_size: Optional[int] = None, accum_dtype: torch.dtype = torch.float32, *,
                 method: str = "auto", deterministic: Optional[bool] = None, logits_dtype: str = "float32",
                 batch_invariant: bool = False, **options: Unpack[LossOptionValues]):
        if "weight" in options:
            raise TypeError("LinearCrossEntropyLoss(weight=...): the LM head's weight (V, H) is forward's second "
                            "argument; class weights of the loss are `ce_weight=` (as in linear_cross_entropy)")
        check_chunk_size(chunk_size)
        check_method(method, chunk_size)
        check_logits_dtype(logits_dtype, method)
        invariant.check(batch_invariant)
        deterministic_mode(deterministic)
        check_flag("return_stats", return_stats)
        check_accum_dtype(accum_dtype)
        super().__init__()
        _set_options(self, "ce_weight", ce_weight, reduction, backend,
                     dict(options, ignore_index=ignore_index, label_smoothing=label_smoothing,
                          lse_square_scale=lse_square_scale, softcap=softcap))
        self.register_buffer("ce_weight", ce_weight)
        self.reduction, self.return_stats, self.backend = reduction, return_stats, backend
        self.chunk_size, self.accum_dtype, self.method = chunk_size, accum_dtype, method
        self.deterministic, self.logits_dtype, self.batch_invariant = deterministic, logits_dtype, batch_invariant

    def extra_repr(self) -> str:
        return _extra_repr(self, "return_stats", "backend", "chunk_size", "accum_dtype", "method",
                           "deterministic", "logits_dtype", "batch_invariant")

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: Optional[torch.Tensor] = None, num_items_in_batch=None, *,
                token_weights: Optional[torch.Tensor] = None):
        return linear_cross_entropy(
            hidden, weight, target, bias, ce_weight=self.ce_weight, reduction=self.reduction,
            num_items_in_batch=num_items_in_batch, chunk_size=self.chunk_size, method=self.method,
            accum_dtype=self.accum_dtype, return_stats=self.return_stats, backend=self.backend,
            deterministic=self.deterministic, token_weights=token_weights, logits_dtype=self.logits_dtype,
            batch_invariant=self.batch_invariant, **_options(self))
