"""``torch.nn.functional`` with fusedce's ``linear_cross_entropy``: switch by changing the import only.

    import fusedce.nn.functional as F          # was: import torch.nn.functional as F
    loss = F.linear_cross_entropy(hidden, lm_head.weight, labels, ignore_index=-100)
    x = F.silu(x)                              # any other name is torch.nn.functional's own

``linear_cross_entropy`` has exactly the signature of ``torch.nn.functional.linear_cross_entropy``
(PyTorch 2.13) and its semantics on class-index targets: the loss of
``F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, weight=weight, reduction=reduction,
ignore_index=ignore_index, label_smoothing=label_smoothing)``, with ``ignore_index=None`` meaning -100 as in
torch. It runs ``fusedce.linear_cross_entropy`` (the logits never exist whole; ignored rows cost no
matmul; label smoothing is fused too, where torch's chunked path falls back to its reference path).

Differences from torch, on purpose:

- ``options`` (``torch.nn.LinearCrossEntropyOptions`` or None) is accepted; its ``batch_chunk_size``, when
  set, becomes fusedce's ``chunk_size`` (rows per chunk); ``acc_policy``, ``chunking_method``,
  ``acc_dtype`` and ``allow_retain_graph`` are ignored (fusedce's math is fp32, its weight gradient
  accumulates in fp32, and a retained graph always works). Anything else is a ``TypeError``.
- The loss is fp32 for every input dtype (torch returns bf16 / fp16 for bf16 / fp16 inputs).
- ``reduction="mean"`` with every target ignored gives 0.0 with zero gradients (torch: NaN); fusedce's
  contract.
- K-dimensional heads (``linear_weight`` (C, d1, ..., H)) raise ``NotImplementedError``.
- Errors are fusedce's (``ValueError`` / ``TypeError`` / ``IndexError``, see the README) where torch
  raises ``RuntimeError``; torch's dimension checks (``input`` 1-D or 2-D) are kept, as ``RuntimeError``.

Probability targets (a float ``target`` of shape ``(N, C)``, or ``(C,)`` for a 1-D ``input``; float32 /
bfloat16 / float16 / float64, any dtype independent of ``input``'s) have torch's semantics exactly: per row
``-sum_c weight_c q'_c log softmax(z)_c`` with ``q' = (1 - label_smoothing) q + label_smoothing / C``,
``"mean"`` dividing by the number of rows whatever the class weights, ``ignore_index`` not applying, every
reduction with backward (``fusedce.linear_cross_entropy``'s probability targets; tested against torch's own
function where it takes them). A target that requires grad is a ``TypeError`` (torch would give it a
gradient; here the target is a constant).
"""
from __future__ import annotations

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
    """``F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, ...)`` through fusedce,
    with torch's argument names and meanings.

    Args:
        input: ``(N, H)`` or ``(H,)`` float32 / bfloat16 / float16 hidden states.
        linear_weight: ``(C, H)``, ``nn.Linear`` layout, ``input``'s dtype.
        target: class indices, ``(N,)`` (or ``()`` for a 1-D ``input``), int64 (int32 accepted); or class
            probabilities ``(N, C)`` (``(C,)``), float32 / bfloat16 / float16 / float64 (module docstring).
        linear_bias: optional ``(C,)``.
        weight: optional ``(C,)`` class weights (``F.cross_entropy``'s).
        reduction: ``"mean"`` (sum over the scored rows / the sum of their class weights), ``"sum"``,
            ``"none"`` (fp32 per row, ``target``'s shape, 0 on ignored rows).
        ignore_index: targets equal to it contribute nothing; None means -100 (torch's default).
        label_smoothing: in [0, 1], ``F.cross_entropy``'s formula.
        options: see the module docstring (``batch_chunk_size`` -> rows per chunk; the rest ignored).

    Returns:
        The fp32 loss; gradients of ``input``, ``linear_weight``, ``linear_bias`` in their dtypes.

    Raises:
        ``RuntimeError`` for an ``input`` that is not 1-D or 2-D (torch's check); ``NotImplementedError``
        for a K-dimensional ``linear_weight``; ``TypeError`` for a probability target that requires grad; ``TypeError`` for ``options`` of
        another type; otherwise ``fusedce.linear_cross_entropy``'s errors.
    """
    if input.dim() not in (1, 2):
        raise RuntimeError(f"expected input with dimensionality 1 or 2, got {input.dim()}")
    if linear_weight.dim() != 2:
        raise NotImplementedError(
            "fusedce.nn.functional.linear_cross_entropy: only a (C, in_features) linear_weight; got "
            f"{tuple(linear_weight.shape)} (K-dimensional loss: use torch.nn.functional.linear_cross_entropy)")
    chunk_size = _chunk_size(options)
    return _fused_linear_cross_entropy(
        input, linear_weight, target, linear_bias, ce_weight=weight, reduction=reduction,
        ignore_index=-100 if ignore_index is None else ignore_index, label_smoothing=label_smoothing,
        chunk_size=chunk_size)


def __getattr__(name: str):
    """Every other name is ``torch.nn.functional``'s (so ``import fusedce.nn.functional as F`` can replace
    ``import torch.nn.functional as F`` whole)."""
    try:
        return getattr(_torch_functional, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(dir(_torch_functional)))
