"""``cross_entropy`` with probability ("soft") targets: the checks of such a target and the op after the
common checks (backend call, reduction, stats). ``functional.cross_entropy`` dispatches here when its
``target`` is a floating-point tensor.

Semantics (``F.cross_entropy`` with class-probability targets, on the classes in the LAST dimension):
per row ``loss = -sum_c w_c q'_c log softmax(z)_c`` with ``q' = (1 - eps) q + eps / V``; the z-loss,
logit scale, softcap and ``token_weights`` as for class indices; no row is ignored (``ignore_index`` does
not apply); ``"mean"`` divides the cross-entropy and the z-loss by the number of rows (or
``num_items_in_batch``), whatever the class weights, as torch does. The row math is the backends'
``soft_cross_entropy_rows`` (``backends/pytorch/soft_targets.py``, ``backends/triton/soft_targets.py``).
"""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core import reduction as red
from fusedce.core import validation as val
from fusedce.core.options import LossOptions

SOFT_TARGET_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def is_soft_target(target) -> bool:
    """A floating-point tensor ``target``: class probabilities."""
    return isinstance(target, torch.Tensor) and target.is_floating_point()


def check_soft_ignore_index(ignore_index: int) -> None:
    """Probability targets ignore no row: a class ``ignore_index`` (>= 0) is a ``ValueError``, as
    ``F.cross_entropy`` refuses it for a floating-point target; a negative one names no class and is
    accepted with no effect (torch's rule, so the default -100 passes)."""
    if ignore_index >= 0:
        raise ValueError(f"ignore_index={ignore_index} names a class, but a floating-point target holds class "
                         "probabilities and no row of it is ignored (F.cross_entropy refuses it too): leave "
                         "ignore_index at its default, or zero the ignored rows with token_weights")


def check_soft_target(target: torch.Tensor, logits: torch.Tensor, opts: LossOptions, values: bool = True) -> None:
    """A probability target: ``TypeError`` unless float32 / bfloat16 / float16 / float64 (independent of
    the logits' dtype) and when it requires grad (a constant here: no gradient reaches it); ``ValueError``
    unless it has ``logits.shape`` (naming both shapes, with a hint for class indices stored as floats)
    and is on the logits' device, for a class ``ignore_index`` (>= 0, as torch), and for
    ``use_token_scaling`` (its ``p_t`` needs a target class);
    ``ValueError`` naming ``target`` and the first position for a negative, NaN or +inf value
    (``validation.check_probabilities``: one host sync, skipped under torch.compile / CUDA-graph capture
    as the target-range check; ``values=False``: not here, the vocab-parallel ops check them in their setup
    collective). ``q`` need not sum to 1, as in torch."""
    if target.dtype not in SOFT_TARGET_DTYPES:
        raise TypeError(f"a floating-point target holds class probabilities and must be float32, bfloat16, "
                        f"float16 or float64, got {target.dtype}")
    if tuple(target.shape) != tuple(logits.shape):
        hint = ""
        if tuple(target.shape) == tuple(logits.shape[:-1]):
            hint = (" (it has logits.shape[:-1]: class indices stored as floats? pass them as an integer "
                    "tensor, target.long())")
        raise ValueError(f"a floating-point target holds class probabilities and must have the logits' shape "
                         f"{tuple(logits.shape)} (..., V), got {tuple(target.shape)}{hint}")
    if target.device != logits.device:
        raise ValueError(f"target is on {target.device} but the data is on {logits.device}")
    if target.requires_grad:
        raise TypeError("probability targets are constants of the loss (no gradient reaches them): pass "
                        "target.detach()")
    if opts.use_token_scaling:
        raise ValueError("use_token_scaling multiplies each row by p_t = softmax(z)[t], which needs a target "
                         "class: it is not defined for probability (float) targets")
    check_soft_ignore_index(opts.ignore_index)
    if values:
        val.check_probabilities(target)   # last: the one host sync (skipped under compile / graph capture)


def backend_rows(impl, backend_name):
    """The backend's ``soft_cross_entropy_rows``; ``NotImplementedError`` naming the backend when it has
    none (the CuTe DSL backend)."""
    if not impl.CAPABILITIES.soft_targets:
        raise NotImplementedError(f"probability (float) targets are not implemented on the "
                                  f"{impl.__name__.rsplit('.', 1)[-1]!r} backend package (backend={backend_name!r}); "
                                  "use backend='triton' or 'torch'")
    return impl.soft_cross_entropy_rows


def cross_entropy(run, rows: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor], opts: LossOptions,
                  reduction: str, num_items_in_batch, inplace_backward: bool, return_stats: bool,
                  token_weights: Optional[torch.Tensor], shape):
    """The op on checked arguments: ``rows`` the logits as (BT, V) with last-dim stride 1, ``target`` the
    probabilities (``rows``' logical shape, before flattening), ``run`` the backend's
    ``soft_cross_entropy_rows``. Returns the fp32 loss, or ``CrossEntropyOutput`` with ``return_stats``:
    ``lse`` per row, ``predicted_tokens`` the argmax of the logits, ``token_accuracy`` the fraction of rows
    whose argmax equals the argmax of the target (lowest index on ties for both; one more read of the
    target), every row counted."""
    n_rows, n_classes = rows.shape
    q = target.reshape(n_rows, n_classes)
    if q.stride(-1) != 1 and n_classes > 1:
        q = q.contiguous()
    ce_rows, lse, _lse_lo, predicted = run(rows, q, weight, opts, inplace_backward, return_stats)
    factor = None if token_weights is None else token_weights.detach().reshape(-1).float()
    scales = red.row_count_scales(n_rows, rows.device, num_items_in_batch) if reduction == "mean" else None
    loss = red.reduce(*red.token_scaled(ce_rows, red.z_rows(lse, opts), factor), reduction, scales, shape)
    if not return_stats:
        return loss
    expected = q.argmax(dim=1)
    return red.stats(loss, lse, predicted, expected, opts, reduction, scales, shape, factor,
                     valid=torch.ones_like(expected, dtype=torch.bool))
