"""``torch.nn.functional`` with fusedce's ``linear_cross_entropy``: switch by changing the import only.

    import fusedce.nn.functional as F          # was: import torch.nn.functional as F
    loss = F.linear_cross_entropy(hidden, lm_head.weight, labels, ignore_index=-100)

``linear_cross_entropy`` has torch's signature and semantics; the differences on purpose are listed in
``docs/contract.md``, "``fusedce.nn.functional.linear_cross_entropy``".
"""
from __future__ import annotations

import re

from typing import Optional

import torch
import torch.nn.functional as _torch_functional

from fusedce.core.entrance import public_op
from fusedce.ce.functional import linear_cross_entropy as _fused_linear_cross_entropy

__all__ = ["linear_cross_entropy"]


def _chunk_size(options) -> Optional[int]:
    if options is None:
        return None
    options_type = getattr(torch.nn, "LinearCrossEntropyOptions", None)   # torch >= 2.13
    if options_type is None or not isinstance(options, options_type):
        raise TypeError("linear_cross_entropy: options must be None or a torch.nn.LinearCrossEntropyOptions, "
                        f"got {type(options).__name__}"
                        + ("" if options_type else f" (torch {torch.__version__} has no LinearCrossEntropyOptions)"))
    return options.batch_chunk_size


def _torch_errors(input, linear_weight, target, linear_bias, ignore_index) -> None:
    """The invalid inputs torch's ``F.linear_cross_entropy`` rejects, with torch's error type and meaning
    (its message, then fusedce's hint), in torch's order, before fusedce's own checks (which would name
    them in fusedce's terms: ``hidden``, ``bias``, ``ValueError``). Checked against torch's OpInfo
    ``error_inputs`` (``tests/linear/test_nn_functional_errors.py``)."""
    if not isinstance(input, torch.Tensor) or not isinstance(linear_weight, torch.Tensor):
        return   # fusedce's TypeError names the argument
    if input.dim() not in (1, 2):
        raise RuntimeError(f"expected input with dimensionality 1 or 2, got {input.dim()}")
    if linear_weight.dim() < 2:
        raise RuntimeError(f"expected linear_weight with dimensionality at least 2, got {linear_weight.dim()} "
                           "(the nn.Linear layout: (C, in_features))")
    if input.shape[-1] != linear_weight.shape[-1]:
        raise RuntimeError("expected equal input and linear_weight last dimensions (in_features), got "
                           f"{input.shape[-1]} and {linear_weight.shape[-1]}, respectively")
    if linear_weight.dim() > 2:
        if input.dim() == 1:
            raise RuntimeError(f"K-dimensional loss defined by linear_weight shape {tuple(linear_weight.shape)} "
                               f"requires batched input, (N, {input.shape[-1]}), got unbatched input with shape "
                               f"{tuple(input.shape)}")
        raise NotImplementedError(
            "fusedce.nn.functional.linear_cross_entropy: only a (C, in_features) linear_weight; got "
            f"{tuple(linear_weight.shape)} (K-dimensional loss: use torch.nn.functional.linear_cross_entropy)")
    n_classes = linear_weight.shape[0]
    if isinstance(linear_bias, torch.Tensor) and tuple(linear_bias.shape) != (n_classes,):
        raise RuntimeError(f"expected linear_bias shape ({n_classes},), got {tuple(linear_bias.shape)}")
    if not isinstance(target, torch.Tensor):
        return
    lead = tuple(input.shape[:-1])
    # the logits' shape: probabilities, whatever the dtype (torch's rule)
    if tuple(target.shape) == lead + (n_classes,):
        if ignore_index is not None:
            raise RuntimeError("ignore_index cannot be specified when target contains probabilities "
                               "(leave it None: no row of a probability target is ignored)")
        if not target.is_floating_point():
            raise RuntimeError(f"Expected floating point type for target with class probabilities, got "
                               f"{_scalar_type(target.dtype)} (a target of the logits' shape {lead + (n_classes,)} "
                               f"holds probabilities; class indices have shape {lead})")
        return
    if tuple(target.shape) == lead and target.dtype not in (torch.int64, torch.int32, torch.uint8):
        hint = "class indices stored as floats? pass target.long()" if target.is_floating_point() else \
            "class indices are int64 (int32 and uint8 accepted): pass target.long()"
        raise RuntimeError(f"expected target dtype to be Long or Byte, but got {_scalar_type(target.dtype)} ({hint})")
    if target.dim() == len(lead) + 1 and target.shape[:-1] == lead:
        raise RuntimeError(f"0D or 1D target tensor expected, multi-target not supported (target of shape "
                           f"{tuple(target.shape)}: class probabilities need (N, C) = {lead + (n_classes,)})")
    if target.dim() >= 1 and lead and target.shape[0] != lead[0]:
        raise ValueError(f"Expected input batch_size ({lead[0]}) to match target batch_size ({target.shape[0]}).")


def _scalar_type(dtype: torch.dtype) -> str:
    """torch's C++ name of ``dtype`` (``Long``, ``Int``, ``Bool``, ``ComplexFloat``, ...), as its messages say."""
    try:
        return torch.empty(0, dtype=dtype).type().rsplit(".", 1)[-1].removesuffix("Tensor")
    except (RuntimeError, TypeError):   # a dtype without a legacy tensor type name
        return str(dtype).removeprefix("torch.")


@public_op("linear", linear=(("input", "linear_weight", "linear_bias"),))
def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    reduction: str = "mean",
    ignore_index: Optional[int] = None,
    label_smoothing: float = 0.0,
    options: Optional[torch.nn.LinearCrossEntropyOptions] = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, ...)`` through fusedce, with
    torch's argument names and meanings (``docs/contract.md``, "``fusedce.nn.functional.linear_cross_entropy``").

    Args:
        input: ``(N, H)`` or ``(H,)`` float32 / bfloat16 / float16 hidden states.
        linear_weight: ``(C, H)``, ``nn.Linear`` layout, ``input``'s dtype.
        target: ``(N,)`` (``()`` for a 1-D ``input``) int64 / int32 / uint8 class indices, or ``(N, C)``
            (``(C,)``) float class probabilities.
        linear_bias: optional ``(C,)``.
        weight: optional ``(C,)`` class weights.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        ignore_index: targets equal to it contribute nothing; None means -100.
        label_smoothing: in [0, 1].
        options: ``torch.nn.LinearCrossEntropyOptions`` or None (``batch_chunk_size`` -> rows per chunk).

    Returns:
        The fp32 loss; gradients of ``input``, ``linear_weight``, ``linear_bias`` in their dtypes.

    Raises:
        Torch's error types for what torch rejects (``_torch_errors``), ``NotImplementedError`` for a
        K-dimensional ``linear_weight``, otherwise :func:`fusedce.linear_cross_entropy`'s errors named in
        this function's argument names.
    """
    _torch_errors(input, linear_weight, target, linear_bias, ignore_index)
    chunk_size = _chunk_size(options)
    if isinstance(target, torch.Tensor) and target.dtype == torch.uint8:
        target = target.long()   # torch takes Byte class indices ("Long or Byte")
    try:
        return _fused_linear_cross_entropy(
            input, linear_weight, target, linear_bias, ce_weight=weight, reduction=reduction,
            ignore_index=-100 if ignore_index is None else ignore_index, label_smoothing=label_smoothing,
            chunk_size=chunk_size)
    except (TypeError, ValueError) as error:
        renamed = _in_torch_terms(str(error))
        if type(error) not in (TypeError, ValueError) or renamed == str(error):
            raise
        raise type(error)(renamed) from None


# fusedce.linear_cross_entropy's argument names -> this function's (torch's): ``ce_weight`` is ``weight``
# here, and ``weight`` / ``bias`` / ``hidden`` are ``linear_weight`` / ``linear_bias`` / ``input``
_TORCH_TERMS = (("ce_weight", "\0CLASS\0"), ("hidden", "input"), ("weight", "linear_weight"),
                ("bias", "linear_bias"), ("\0CLASS\0", "weight"))


def _in_torch_terms(message: str) -> str:
    """An error message of ``fusedce.linear_cross_entropy`` with its argument names replaced by this
    function's (``_TORCH_TERMS``; whole words only: ``weights`` or ``token_weights`` stay)."""
    for ours, theirs in _TORCH_TERMS:
        message = re.sub(rf"(?<![\w.]){re.escape(ours)}(?!\w)", theirs, message)
    return message


def __getattr__(name: str):
    """Every other name is ``torch.nn.functional``'s (so ``import fusedce.nn.functional as F`` can replace
    ``import torch.nn.functional as F`` whole)."""
    try:
        return getattr(_torch_functional, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(dir(_torch_functional)))
