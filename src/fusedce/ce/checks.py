"""The one checked call of the cross-entropy family: each face (``cross_entropy``, ``linear_cross_entropy``,
their vocab-parallel forms; the modules and the drop-in call those) runs its argument checks here, in its
documented order, before any kernel, and gets a ``CECall``. What needs the global vocabulary (the
vocab-parallel target range) stays with the op, after its setup collective."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from fusedce import backends
from fusedce.core import reduction as red, validation as val
from fusedce.core.options import LossOptions, check_flag, deterministic_mode, loss_options
from fusedce.lm_head import invariant
from fusedce.lm_head.head import check_logits_dtype, check_method, resolve_method

PROBS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_PROBS = "probability targets (a float target of shape (..., V))"


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """How a linear op forms its logits: ``method`` resolved ("chunked" / "tiled"), ``rows`` per chunk (None:
    the rule), the logits' and the accumulators' dtypes, ``deterministic``, ``batch_invariant``."""

    method: str
    rows: Optional[int]
    logits: str = "float32"
    accum_dtype: torch.dtype = torch.float32
    deterministic: bool = False
    batch_invariant: bool = False


@dataclasses.dataclass(frozen=True)
class CECall:
    """The checked arguments of a cross-entropy op."""

    opts: LossOptions
    reduction: str
    lead: torch.Size                       # the tokens' leading shape
    target: torch.Tensor                   # (n,) class indices, int64-safe; or (n, V) probabilities (``probs``)
    probs: bool
    backend: str                           # the resolved backend's name (``backends.named``)
    class_weights: Optional[torch.Tensor]  # (V,) detached, or None
    token_weights: Optional[torch.Tensor]  # (n,) fp32 constants (0 on ignored rows), or None
    scales: Optional[red.MeanScales]       # the mean's (1/D, 1/N); None unless reduction == "mean"
    num_items: object = None
    return_stats: bool = False
    inplace_backward: bool = False
    head: Optional[HeadSpec] = None        # the linear ops'


def is_probs(target) -> bool:
    """A floating-point tensor ``target``: class probabilities."""
    return isinstance(target, torch.Tensor) and target.is_floating_point()


def check_probs_ignore_index(ignore_index: int) -> None:
    """``ValueError`` for a class ``ignore_index`` (>= 0) with probability targets, as ``F.cross_entropy``."""
    if ignore_index >= 0:
        raise ValueError(f"ignore_index={ignore_index} names a class, but a floating-point target holds class "
                         "probabilities and no row of it is ignored (F.cross_entropy refuses it too): leave "
                         "ignore_index at its default, or zero the ignored rows with token_weights")


def check_probs(target: torch.Tensor, data: torch.Tensor, opts: LossOptions, n_classes: Optional[int] = None,
                values: bool = True) -> None:
    """A probability target's dtype, shape (``data.shape``, or ``data.shape[:-1] + (n_classes,)`` for the
    linear ops, ``data`` then ``hidden``), device and constness, the options it refuses and (``values``) its
    values (the one host sync)."""
    if target.dtype not in PROBS_DTYPES:
        raise TypeError(f"a floating-point target holds class probabilities and must be float32, bfloat16, "
                        f"float16 or float64, got {target.dtype}")
    linear = n_classes is not None
    expected = tuple(data.shape[:-1]) + (n_classes,) if linear else tuple(data.shape)
    if tuple(target.shape) != expected:
        hint = ""
        if linear and tuple(target.shape) == tuple(data.shape[:-1]):
            hint = " (it has hidden.shape[:-1]: class indices stored as floats? pass target.long())"
        elif not linear and tuple(target.shape) == tuple(data.shape[:-1]):
            hint = (" (it has logits.shape[:-1]: class indices stored as floats? pass them as an integer "
                    "tensor, target.long())")
        shape = f"shape hidden.shape[:-1] + (V,) = {expected}" if linear else f"the logits' shape {expected} (..., V)"
        raise ValueError(f"a floating-point target holds class probabilities and must have {shape}, got "
                         f"{tuple(target.shape)}{hint}")
    if target.device != data.device:
        raise ValueError(f"target is on {target.device} but {'hidden' if linear else 'the data'} is on {data.device}")
    if target.requires_grad:
        raise TypeError("probability targets are constants of the loss (no gradient reaches them): pass "
                        "target.detach()")
    if opts.use_token_scaling:
        raise ValueError("use_token_scaling multiplies each row by p_t = softmax(z)[t], which needs a target "
                         "class: it is not defined for probability (float) targets")
    check_probs_ignore_index(opts.ignore_index)
    if values:
        val.check_probabilities(target)   # last: the one host sync (skipped under compile / graph capture)


def probs_backend(impl, name) -> str:
    """``impl``'s name; ``NotImplementedError`` naming it (``name``: the caller's ``backend=``) when it has no
    probability targets (the CuTe DSL backend)."""
    if not impl.CAPABILITIES.probs_targets:
        raise NotImplementedError(f"probability (float) targets are not implemented on the "
                                  f"{impl.__name__.rsplit('.', 1)[-1]!r} backend package (backend={name!r}); "
                                  "use backend='triton' or 'torch'")
    return impl.NAME


def flat_probs(target: torch.Tensor, n: int, n_classes: int) -> torch.Tensor:
    """``target`` as (n, V), unit stride along the classes (one copy only when it is not)."""
    q = target.reshape(n, n_classes)
    return q.contiguous() if q.stride(-1) != 1 and n_classes > 1 else q


def _probs_weights(token_weights):
    return None if token_weights is None else token_weights.detach().reshape(-1).float()


def _index_weights(token_weights, flat_target, opts: LossOptions, lead, n_classes: Optional[int]):
    """The row form of ``token_weights`` and (``n_classes`` given) the target-range check's one host sync."""
    token_weights = red.row_token_weights(token_weights, flat_target, opts.ignore_index)
    if n_classes is not None:
        val.check_target_range(flat_target.reshape(lead), n_classes, opts.ignore_index,
                               None if token_weights is None else token_weights.reshape(lead))
    return token_weights


def _index_scales(call_reduction, flat_target, class_weights, opts, num_items):
    if call_reduction != "mean":
        return None
    return red.mean_scales(flat_target, red.target_weights(flat_target, class_weights, opts.ignore_index),
                           opts.ignore_index, num_items)


def checked_cross_entropy(logits, target, weight, *, reduction, num_items_in_batch, inplace_backward, return_stats,
                          backend, token_weights, batch_invariant, options) -> CECall:
    """``cross_entropy``'s checks (class indices or probabilities) and the target-range check's sync."""
    val.check_not_swapped("logits", logits, target, "cross_entropy(logits, target)")
    val.check_float("logits", logits)
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the classes, last)")
    val.check_nonzero("logits", logits.shape, -1, "V")
    opts = loss_options(reduction, **options)
    shape, n_classes = logits.shape[:-1], logits.shape[-1]
    probs = is_probs(target)
    if probs:
        check_probs(target, logits, opts, values=False)   # values below, with token_weights
    else:
        val.check_target(target, shape, logits.device, lambda t: val.class_dim_hint(tuple(logits.shape), t),
                         probabilities=True, data="logits")
        target = val.widen_target(target, opts.ignore_index)   # int32 vs an ignore_index beyond int32
    val.check_vector("weight", weight, n_classes, logits.device, constant=True, position="third")
    val.check_num_items(num_items_in_batch, logits.device)
    check_flag("inplace_backward", inplace_backward)
    check_flag("return_stats", return_stats)
    if batch_invariant is not False:   # the default needs no check
        invariant.check(batch_invariant)
    val.check_token_weights(token_weights, target, shape)
    if probs:   # the probability values and the token weights: one host sync
        val.check_probabilities(target, token_weights=token_weights)
    weight = None if weight is None else weight.detach()   # class weights are constants (as in torch)
    impl = backends.get(backend, logits.device)
    if batch_invariant:
        invariant.check_backend(batch_invariant, impl)
    n = shape.numel()
    if probs:
        invariant.refuse(batch_invariant, _PROBS)
        name = probs_backend(impl, backend)
        scales = red.row_count_scales(n, logits.device, num_items_in_batch) if reduction == "mean" else None
        return CECall(opts, reduction, shape, flat_probs(target, n, n_classes), True, name, weight,
                      _probs_weights(token_weights), scales, num_items_in_batch, return_stats, inplace_backward)
    flat = target.reshape(-1)
    token_weights = _index_weights(token_weights, flat, opts, target.shape, n_classes)
    return CECall(opts, reduction, shape, flat, False, impl.NAME, weight, token_weights,
                  _index_scales(reduction, flat, weight, opts, num_items_in_batch), num_items_in_batch,
                  return_stats, inplace_backward)


def checked_linear_cross_entropy(hidden, weight, target, bias, *, ce_weight, reduction, num_items_in_batch,
                                 chunk_size, method, accum_dtype, return_stats, backend, deterministic,
                                 token_weights, logits_dtype, batch_invariant, options) -> CECall:
    """``linear_cross_entropy``'s checks (class indices or probabilities) and the target-range check's sync."""
    opts = loss_options(reduction, **options)
    probs = is_probs(target)
    val.check_linear(hidden, weight, target, bias, ce_weight, chunk_size, accum_dtype)
    check_method(method, chunk_size)
    check_logits_dtype(logits_dtype, method)
    if batch_invariant is not False:   # the default needs no check
        invariant.check(batch_invariant)
    deterministic = deterministic_mode(deterministic)
    method = resolve_method(method)
    head = HeadSpec(method, invariant.ROWS if batch_invariant else _rows(chunk_size), logits_dtype, accum_dtype,
                    deterministic, batch_invariant)
    shape, n_classes = hidden.shape[:-1], weight.shape[0]
    n = shape.numel()
    if probs:
        invariant.refuse(batch_invariant, _PROBS)
        check_probs(target, hidden, opts, n_classes, values=False)
        val.check_num_items(num_items_in_batch, hidden.device)
        check_flag("return_stats", return_stats)
        val.check_token_weights(token_weights, target, shape)
        val.check_probabilities(target, token_weights=token_weights)   # one host sync for both
        name = probs_backend(backends.get(backend, hidden.device, tiled=method == "tiled"), backend)
        scales = red.row_count_scales(n, hidden.device, num_items_in_batch) if reduction == "mean" else None
        return CECall(opts, reduction, shape, flat_probs(target, n, n_classes), True, name,
                      None if ce_weight is None else ce_weight.detach(), _probs_weights(token_weights), scales,
                      num_items_in_batch, return_stats, head=head)
    target = val.widen_target(target, opts.ignore_index)   # int32 vs an ignore_index beyond int32
    val.check_num_items(num_items_in_batch, hidden.device)
    check_flag("return_stats", return_stats)
    val.check_token_weights(token_weights, target)
    ce_weight = None if ce_weight is None else ce_weight.detach()   # class weights are constants
    impl = backends.get(backend, hidden.device, tiled=method == "tiled")
    if batch_invariant:
        invariant.check_backend(batch_invariant, impl)
    flat = target.reshape(-1)
    token_weights = _index_weights(token_weights, flat, opts, target.shape, n_classes)
    return CECall(opts, reduction, shape, flat, False, impl.NAME, ce_weight, token_weights,
                  _index_scales(reduction, flat, ce_weight, opts, num_items_in_batch), num_items_in_batch,
                  return_stats, head=head)


def _rows(chunk_size) -> Optional[int]:
    """A checked ``chunk_size`` as an int (None: the rule, decided in the loop op)."""
    return None if chunk_size is None else int(chunk_size)


_SHARD_NAMES = ("weight_shard", "bias_shard", "ce_weight_shard")


def checked_vocab_parallel(logits_shard, target, weight_shard, *, reduction, num_items_in_batch, return_stats,
                           backend, token_weights, options) -> CECall:
    """``vocab_parallel_cross_entropy``'s checks; its target range (the global V) is the op's, after its setup
    collective (``check_range``)."""
    val.check_float("logits_shard", logits_shard)
    if logits_shard.dim() < 1:
        raise ValueError("logits_shard must have at least one dimension (the classes, last)")
    opts = loss_options(reduction, **options)
    shape, n_local, device = logits_shard.shape[:-1], logits_shard.shape[-1], logits_shard.device
    n = shape.numel()
    if is_probs(target):
        check_probs(target, logits_shard, opts, values=False)
        val.check_vector("weight_shard", weight_shard, n_local, device, constant=True)
        val.check_num_items(num_items_in_batch, device)
        check_flag("return_stats", return_stats)
        val.check_token_weights(token_weights, target, shape)
        name = probs_backend(backends.get(backend, device), backend)
        w = None if weight_shard is None else weight_shard.detach().float().contiguous()
        return CECall(opts, reduction, shape, flat_probs(target, n, n_local), True, name, w,
                      _probs_weights(token_weights), None, num_items_in_batch, return_stats)
    val.check_target(target, shape, device)
    target = val.widen_target(target, opts.ignore_index)   # int32 vs an ignore_index beyond int32
    val.check_vector("weight_shard", weight_shard, n_local, device, constant=True)
    val.check_num_items(num_items_in_batch, device)
    check_flag("return_stats", return_stats)
    val.check_token_weights(token_weights, target)
    name = backends.get(backend, device).NAME
    flat = target.reshape(-1)
    return CECall(opts, reduction, shape, flat, False, name, weight_shard,
                  _index_weights(token_weights, flat, opts, shape, None), None, num_items_in_batch, return_stats)


def checked_vocab_parallel_linear(hidden, weight_shard, target, bias_shard, *, ce_weight_shard, reduction,
                                  num_items_in_batch, chunk_size, accum_dtype, return_stats, backend, deterministic,
                                  token_weights, options) -> CECall:
    """``vocab_parallel_linear_cross_entropy``'s checks (``deterministic`` checked, nothing to select)."""
    if is_probs(target):
        deterministic_mode(deterministic)
        opts = loss_options(reduction, **options)
        val.check_linear(hidden, weight_shard, target, bias_shard, ce_weight_shard, chunk_size, accum_dtype,
                         names=_SHARD_NAMES, sharded=True)
        check_probs(target, hidden, opts, weight_shard.shape[0], values=False)
        val.check_num_items(num_items_in_batch, hidden.device)
        check_flag("return_stats", return_stats)
        val.check_token_weights(token_weights, target, hidden.shape[:-1])
        name = probs_backend(backends.get(backend, hidden.device), backend)
        shape = hidden.shape[:-1]
        w = None if ce_weight_shard is None else ce_weight_shard.detach().float().contiguous()
        return CECall(opts, reduction, shape, flat_probs(target, shape.numel(), weight_shard.shape[0]), True, name,
                      w, _probs_weights(token_weights), None, num_items_in_batch, return_stats,
                      head=HeadSpec("chunked", _rows(chunk_size), accum_dtype=accum_dtype))
    val.check_linear(hidden, weight_shard, target, bias_shard, ce_weight_shard, chunk_size, accum_dtype,
                     names=_SHARD_NAMES, sharded=True)
    deterministic_mode(deterministic)   # checked; nothing to select (the op's docstring)
    opts = loss_options(reduction, **options)
    target = val.widen_target(target, opts.ignore_index)   # int32 vs an ignore_index beyond int32
    val.check_num_items(num_items_in_batch, hidden.device)
    check_flag("return_stats", return_stats)
    val.check_token_weights(token_weights, target)
    name = backends.get(backend, hidden.device).NAME
    flat = target.reshape(-1)
    return CECall(opts, reduction, target.shape, flat, False, name, ce_weight_shard,
                  _index_weights(token_weights, flat, opts, target.shape, None), None, num_items_in_batch,
                  return_stats, head=HeadSpec("chunked", _rows(chunk_size), accum_dtype=accum_dtype))


def check_range(call: CECall, n_classes: int) -> None:
    """The class-index target's range against the global ``n_classes`` (with the token weights' values: one
    host sync), for the vocab-parallel ops after their setup collective."""
    if not call.probs:
        val.check_target_range(call.target.reshape(call.lead), n_classes, call.opts.ignore_index,
                               None if call.token_weights is None else call.token_weights.reshape(call.lead))
