"""Public functions: normalize arguments, validate, pick the backend, apply the reduction."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import torch

from fusedce.core.entrance import public_op
from fusedce import backends
from fusedce.ce import linear_function, linear_probs, probs_targets as soft
from fusedce.ce.checks import checked_cross_entropy, checked_linear_cross_entropy
from fusedce.core import reduction as red
from fusedce.core.row_math import target_probability
from fusedce.core.rows import rows_view
from fusedce.core.types import CrossEntropyOutput
from fusedce.core.options import LossOptionValues

if TYPE_CHECKING:
    from typing_extensions import Unpack


@public_op("logits")
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None, *,
                  reduction: str = "mean", num_items_in_batch: Union[int, torch.Tensor, None] = None,
                  inplace_backward: bool = False, return_stats: bool = False, backend: Optional[str] = None,
                  token_weights: Optional[torch.Tensor] = None, batch_invariant: bool = False,
                  **options: Unpack[LossOptionValues]) -> Union[torch.Tensor, CrossEntropyOutput]:
    """Cross-entropy over the LAST dimension of ``logits``, computed in fp32: ``F.cross_entropy``'s formula
    (``core/row_math.py``); the full contract is ``docs/contract.md``, "``fusedce.cross_entropy``".

    Args:
        logits: ``(..., V)`` float32 / bfloat16 / float16, any row stride.
        target: ``(...)`` = ``logits.shape[:-1]`` int64 / int32 class indices, or class probabilities of
            ``logits.shape`` (any float dtype; a constant; contract, "Probability targets").
        weight: optional ``(V,)`` float class weights (constants).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (fp32 of ``target.shape``).
        num_items_in_batch: int or 0-dim tensor, the mean's denominator (gradient accumulation).
        inplace_backward: the backward writes the gradient into ``logits``' storage.
        return_stats: return ``CrossEntropyOutput(loss, z_loss, lse, token_accuracy, predicted_tokens)``.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"`` / ``"cute"``; None reads ``$FUSEDCE_BACKEND``.
        token_weights: optional ``(...)`` = ``target.shape`` float per-token loss weights (constants).
        batch_invariant: each row's outputs and gradient bitwise independent of the other rows.
        **options: the loss options, listed under "Loss options" below.

    Returns:
        The fp32 loss (scalar, or ``target.shape`` for ``"none"``), or ``CrossEntropyOutput``; the
        gradient has the logits' dtype and shape, exactly 0 on ignored rows.

    Raises:
        TypeError: a tensor or option of the wrong kind (non-float logits, a bool ``ignore_index``, ...).
        ValueError: a shape, device, reduction, option value or backend outside the contract.
        IndexError: a target neither ``ignore_index`` nor in ``[0, V)`` (host-checked once).
        RuntimeError: a backend unavailable for these tensors (``"triton"`` on CPU without the interpreter).
        NotImplementedError: probability targets with ``backend="cute"``.
    """
    call = checked_cross_entropy(logits, target, weight, reduction=reduction, num_items_in_batch=num_items_in_batch,
                                 inplace_backward=inplace_backward, return_stats=return_stats, backend=backend,
                                 token_weights=token_weights, batch_invariant=batch_invariant, options=options)
    rows = rows_view(logits, inplace_backward)
    impl = backends.named(call.backend)
    if call.probs:   # ce/probs_targets.py: F.cross_entropy's probability targets
        return soft.cross_entropy(call, impl, rows)
    opts, flat_target = call.opts, call.target
    ce_rows, lse, lse_lo, predicted = impl.cross_entropy_rows(
        rows, flat_target, call.class_weights, opts, inplace_backward, return_stats)
    token_weight = None
    if opts.use_token_scaling:
        token_weight = target_probability(rows, flat_target, lse.detach(), lse_lo, opts)
    return red.loss_and_stats(ce_rows, lse, predicted, flat_target, opts, reduction, call.scales, call.lead,
                              return_stats, red.times(token_weight, call.token_weights))


@public_op("linear", hints=dict(weight="the second argument is the LM head's weight (V, H); class weights of the loss are `ce_weight=`"))
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, *, ce_weight: Optional[torch.Tensor] = None,
                         reduction: str = "mean", num_items_in_batch: Union[int, torch.Tensor, None] = None,
                         chunk_size: Optional[int] = None, method: str = "auto",
                         accum_dtype: torch.dtype = torch.float32, return_stats: bool = False,
                         backend: Optional[str] = None, deterministic: Optional[bool] = None,
                         token_weights: Optional[torch.Tensor] = None, logits_dtype: str = "float32",
                         batch_invariant: bool = False,
                         **options: Unpack[LossOptionValues]) -> Union[torch.Tensor, CrossEntropyOutput]:
    """``cross_entropy(hidden @ weight.T + bias, target)`` without ever allocating the BT x V logits; the
    full contract is ``docs/contract.md``, "``fusedce.linear_cross_entropy``".

    Args:
        hidden: ``(..., H)`` float32 / bfloat16 / float16 (the last hidden states).
        weight: ``(V, H)``, the LM head in ``nn.Linear`` layout, ``hidden``'s dtype.
        target: ``(...)`` = ``hidden.shape[:-1]`` int64 / int32, or class probabilities ``(..., V)``.
        bias: optional ``(V,)``, ``hidden``'s dtype.
        ce_weight: optional ``(V,)`` class weights of the loss.
        reduction, num_items_in_batch, return_stats, backend, token_weights: as in :func:`cross_entropy`.
        chunk_size: tokens per chunk (``method="chunked"``); None: automatic (``lm_head/head.py``).
        method: ``"chunked"``, ``"tiled"`` (no tensor of V or more elements) or ``"auto"``.
        accum_dtype: dtype in which the ``weight`` and ``bias`` gradients accumulate.
        deterministic: bitwise identical run to run; None follows torch's deterministic flag.
        logits_dtype: ``"float32"`` (logits exact in fp32) or ``"input"`` (rounded as ``F.linear``).
        batch_invariant: each row's outputs and gradient bitwise independent of the other rows.
        **options: the loss options, listed under "Loss options" below.

    Returns:
        The fp32 loss, or ``CrossEntropyOutput``; the gradients have their tensors' dtypes.

    Raises:
        The errors of :func:`cross_entropy`; ``ValueError`` / ``TypeError`` for a head, ``chunk_size``,
        ``method``, ``accum_dtype``, ``logits_dtype`` or ``deterministic`` outside the contract.
    """
    call = checked_linear_cross_entropy(
        hidden, weight, target, bias, ce_weight=ce_weight, reduction=reduction, num_items_in_batch=num_items_in_batch,
        chunk_size=chunk_size, method=method, accum_dtype=accum_dtype, return_stats=return_stats, backend=backend,
        deterministic=deterministic, token_weights=token_weights, logits_dtype=logits_dtype,
        batch_invariant=batch_invariant, options=options)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    if call.probs:   # ce/linear_probs.py: probability targets
        return linear_probs.linear_cross_entropy(call, flat_hidden, weight, bias)
    loss, lse, predicted, token_weight = linear_function.linear_cross_entropy(call, flat_hidden, weight, bias)
    if reduction == "none":
        loss = loss.reshape(call.lead)
    if not return_stats:
        return loss
    return red.stats(loss, lse, predicted, call.target, call.opts, reduction, call.scales, call.lead, token_weight)
