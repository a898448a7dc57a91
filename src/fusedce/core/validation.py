"""Tensor argument checks of the public contract; each runs before any kernel writes anything."""
from __future__ import annotations

import numbers
from typing import Callable, Optional

import torch
import torch._guards  # noqa: F401  (imported by torch itself: no cost)
import torch.fx._symbolic_trace  # noqa: F401  (likewise)

from fusedce.core.options.schema import (FP32_NORMAL, INT32_RANGE, SYMBOLIC, check_accum_dtype, check_chunk_size,
                                         finite, fp32_range)
from fusedce.core.hints import (class_dim_hint, module_hint, positional_hint, reshape_hint,  # noqa: F401 (val.*_hint)
                                 swapped_hint)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)


def widen_target(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``target`` as int64 (one BT-element copy) when int32 could not hold ``ignore_index``, else as is."""
    if target.dtype == torch.int32 and not INT32_RANGE[0] <= ignore_index <= INT32_RANGE[1]:
        return target.long()
    return target


def check_nonzero(name: str, shape, dim: int, what: str) -> None:
    """``ValueError`` when ``shape[dim]`` (``what``: "V", the classes, or "H", the hidden size) is 0."""
    if shape[dim] == 0:
        raise ValueError(f"{what} = 0: {name} has shape {tuple(shape)}; "
                         f"{'the number of classes' if what == 'V' else 'the hidden size'} must be > 0")


def check_target(target: torch.Tensor, expected_shape, device: torch.device,
                 hint: Optional[Callable[[tuple], str]] = None, probabilities: bool = False,
                 data: str = "the data") -> None:
    """``target``: an int32/int64 tensor of ``expected_shape`` on ``device`` (``data``'s, the argument named in a
    device mismatch); ``hint(target.shape)`` names the likely mistake of a wrong shape."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a tensor, got {type(target).__name__}")
    if target.dtype not in INDEX_DTYPES:
        also = (" class indices, or a float32 / bfloat16 / float16 / float64 tensor with a last dimension "
                "of V (class probabilities)") if probabilities else ""
        floats = "" if probabilities or not target.is_floating_point() else " (class indices stored as floats? " \
            "pass target.long(); this op takes no class probabilities)"
        raise TypeError(f"target must be int64 or int32{also}, got {target.dtype}{floats}")
    if tuple(target.shape) != tuple(expected_shape):
        soft = ""
        if probabilities and target.dim() == len(expected_shape) + 1 and \
                tuple(target.shape[:-1]) == tuple(expected_shape):
            soft = (" (an integer target with a class dimension: class probabilities must be a floating-point "
                    "tensor, e.g. target.float())")
        extra = hint(tuple(target.shape)) if hint is not None and not soft else ""   # one f-string: Dynamo
        extra = extra or ("" if soft else reshape_hint(tuple(target.shape), tuple(expected_shape)))
        raise ValueError(f"target shape {tuple(target.shape)} must equal {tuple(expected_shape)}{soft}{extra}")
    if target.device != device:
        raise ValueError(f"target is on {target.device} but {data} is on {device}: move one to the other's device")


def check_not_swapped(name: str, logits, target, call: str) -> None:
    """``TypeError`` for integer ``logits`` beside a floating-point ``target``: the two passed in each other's place."""
    if (isinstance(logits, torch.Tensor) and not logits.is_floating_point() and isinstance(target, torch.Tensor)
            and target.is_floating_point()):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {logits.dtype}, and target is "
                        f"{target.dtype}: {name} and target swapped? {call}")


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}{module_hint(name, t)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def check_vector(name: str, t: Optional[torch.Tensor], size: int, device: torch.device,
                 constant: bool = False, position: str = "") -> None:
    """An optional ``(size,)`` float tensor on ``device`` (class weights, bias). ``constant`` (class weights, which get
    no gradient): one that requires grad in grad mode is a ``TypeError``, as in ``F.cross_entropy``."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        got = t.dtype if isinstance(t, torch.Tensor) else f"{type(t).__name__} {t!r}"
        hint = positional_hint(name, t, position) if position else ""
        raise TypeError(f"{name} must be a floating-point tensor, got {got}{hint}")
    if constant and t.requires_grad and torch.is_grad_enabled():
        raise TypeError(f"{name} requires grad, but class weights are a constant of the loss (no gradient; "
                        f"F.cross_entropy refuses them too): pass {name}.detach()")
    if t.dim() != 1 or t.shape[0] != size:
        raise ValueError(f"{name} must have shape ({size},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the data is on {device}")


def check_class_weights(name: str, t: Optional[torch.Tensor]) -> None:
    """A module's optional class weights before V is known: a 1-D floating-point tensor (``TypeError`` /
    ``ValueError``)."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        got = t.dtype if isinstance(t, torch.Tensor) else f"{type(t).__name__} {t!r}"
        raise TypeError(f"{name} must be a floating-point tensor, got {got}{positional_hint(name, t, 'first')}")
    if t.dim() != 1:
        raise ValueError(f"{name} must have shape (V,), got {tuple(t.shape)}")


def values_unavailable(*tensors) -> bool:
    """Whether the values of ``tensors`` cannot be read on the host: meta or fake tensors, an active fake or
    proxy mode, or ``torch.fx.symbolic_trace``."""
    key = torch._C._TorchDispatchModeKey
    if (torch._C._get_dispatch_mode(key.PROXY) is not None
            or torch._C._get_dispatch_mode(key.FAKE) is not None):
        return True
    present = [t for t in tensors if isinstance(t, torch.Tensor)]
    if any(t.device.type == "meta" for t in present):
        return True
    if any(type(t) is not torch.Tensor for t in present) and torch._guards.detect_fake_mode(present) is not None:
        return True
    return torch.fx._symbolic_trace.is_fx_symbolic_tracing()


def host_readable(*tensors) -> bool:
    """True when the host may read ``tensors``' values: not compiling, not capturing, not ``values_unavailable``."""
    if torch.compiler.is_compiling() or values_unavailable(*tensors):
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return True



class TargetOutOfRange(IndexError):
    """The ``IndexError`` of :func:`check_target_range`, with the fields a caller needs to name the user's own
    element (the Hugging Face patch's shifted labels)."""

    def __init__(self, message: str, position: tuple, value: int, n_classes: int, ignore_index: int):
        super().__init__(message)
        self.position, self.value, self.n_classes, self.ignore_index = position, value, n_classes, ignore_index


def check_token_weights(token_weights, target: torch.Tensor, shape=None) -> None:
    """``token_weights``: None, or a float tensor of ``shape`` (default ``target.shape``) on the target's device."""
    if token_weights is None:
        return
    if not isinstance(token_weights, torch.Tensor) or not token_weights.is_floating_point():
        kind = token_weights.dtype if isinstance(token_weights, torch.Tensor) else type(token_weights).__name__
        raise TypeError(f"token_weights must be a floating-point tensor, got {kind}")
    expected = tuple(target.shape if shape is None else shape)
    if tuple(token_weights.shape) != expected:
        also = " (logits.shape[:-1] for probability targets)" if shape is not None else ""
        raise ValueError(f"token_weights shape {tuple(token_weights.shape)} must equal the target's {expected}{also}")
    if token_weights.device != target.device:
        raise ValueError(f"token_weights is on {token_weights.device} but the target is on {target.device}")


def check_target_range(target: torch.Tensor, n_classes: int, ignore_index: int,
                       token_weights: Optional[torch.Tensor] = None) -> None:
    """``IndexError`` (``TargetOutOfRange``) for the first target outside ``[0, V)`` and not ignored, then
    ``ValueError`` for the first kept row with a NaN or infinite token weight."""
    if target.numel() == 0 or not host_readable(target, token_weights):
        return
    kept = target != ignore_index
    bad = kept & ((target < 0) | (target >= n_classes))
    bad_weight = None if token_weights is None else kept & ~torch.isfinite(token_weights)
    if not bool((bad if bad_weight is None else bad | bad_weight).any()):   # the one sync
        return
    if bad_weight is not None and not bool(bad.any()):   # (error paths only from here)
        assert token_weights is not None
        flat = bad_weight.reshape(-1).nonzero()[0, 0]
        at = [int(i) for i in torch.unravel_index(flat, tuple(target.shape))]
        raise ValueError(f"token_weights{at} = {float(token_weights.reshape(-1)[flat])} on a non-ignored row: "
                         "token weights must be finite")
    flat = bad.reshape(-1).nonzero()[0, 0]
    pos = tuple(int(i) for i in torch.unravel_index(flat, tuple(target.shape)))
    value = int(target.reshape(-1)[flat])
    raise TargetOutOfRange(
        f"target{list(pos)} = {value} is out of range: expected ignore_index={ignore_index} "
        f"or a class in [0, {n_classes}) (V = {n_classes})", pos, value, n_classes, ignore_index)


def bad_probabilities(target: torch.Tensor) -> Optional[torch.Tensor]:
    """A 0-dim bool device tensor: does the probability target ``target`` hold a negative, NaN or +inf value?"""
    if target.numel() == 0 or not host_readable(target):
        return None
    # one reduction, no temporary of the target's size (bool masks would be 3 BT V bytes); aminmax propagates NaN
    low, high = torch.aminmax(target)
    return (low < 0) | torch.isnan(low) | (high == float("inf"))


def raise_bad_probabilities(target: torch.Tensor, name: str = "target") -> None:
    """The ``ValueError`` naming the first negative, NaN or +inf probability (error path: reads it back)."""
    bad = ((target < 0) | ~torch.isfinite(target)).reshape(-1).nonzero()[0, 0]
    pos = [int(i) for i in torch.unravel_index(bad, tuple(target.shape))]
    value = float(target.reshape(-1)[bad])
    hint = " (log-probabilities? pass their exp(), e.g. softmax of the teacher's logits)" if value < 0 else ""
    if value == float("inf"):
        hint = " (an overflow upstream? probabilities come from a softmax, or a normalized count)"
    raise ValueError(f"{name}{pos} = {value}: a floating-point {name} holds class probabilities, which must "
                     f"be >= 0 and not NaN or +inf{hint}")


def check_probabilities(target: torch.Tensor, name: str = "target",
                        token_weights: Optional[torch.Tensor] = None) -> None:
    """``ValueError`` naming the first negative, NaN or +inf probability, then the first non-finite token
    weight."""
    flag = bad_probabilities(target)
    if flag is None:
        return
    if token_weights is not None:
        flag = flag | ~torch.isfinite(token_weights).all()
    if not bool(flag):   # the one sync
        return
    if bool(bad_probabilities(target)):   # (error paths only from here)
        raise_bad_probabilities(target, name)
    assert token_weights is not None
    flat = (~torch.isfinite(token_weights)).reshape(-1).nonzero()[0, 0]
    pos = [int(i) for i in torch.unravel_index(flat, tuple(token_weights.shape))]
    raise ValueError(f"token_weights{pos} = {float(token_weights.reshape(-1)[flat])}: token weights must be "
                     "finite (with probability targets every row counts)")


def check_linear(hidden, weight, target, bias, ce_weight, chunk_size, accum_dtype=torch.float32,
                 names=("weight", "bias", "ce_weight"), sharded=False, probabilities=True) -> None:
    """Checks of the linear ops: ``hidden`` (..., H) and ``weight`` (V, H) of one float dtype and device, (V,)
    vectors, ``chunk_size``, ``accum_dtype``; ``probabilities`` accepts float targets."""
    w_name, b_name, cw_name = names
    check_float("hidden", hidden)
    check_float(w_name, weight)
    probs = probabilities and isinstance(target, torch.Tensor) and target.is_floating_point()
    if hidden.dim() < 1 or weight.dim() != 2:
        lead = (tuple(hidden.shape[:-1]) if hidden.dim() >= 1 else ()) if probs else getattr(target, "shape", ())
        swapped = swapped_hint(tuple(hidden.shape), tuple(weight.shape), tuple(lead))
        swapped = swapped.replace(" (hidden.shape[:-1]);", ";")
        raise ValueError(f"hidden must be (..., H) and {w_name} (V, H); got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}{swapped}")
    check_nonzero("hidden", hidden.shape, -1, "H")
    check_nonzero(w_name, weight.shape, 1, "H")
    if not sharded:
        check_nonzero(w_name, weight.shape, 0, "V")
    if hidden.shape[-1] != weight.shape[1]:
        # hidden's width is weight's first dimension: either the head is transposed (H, V) or hidden holds
        # logits (..., V); a head has more rows (V) than columns (H) in practice, which tells the two apart
        matches_rows = weight.shape[0] == hidden.shape[-1]
        logits = matches_rows and weight.shape[0] > weight.shape[1]
        layout = (f"; hidden looks like logits (..., V = {weight.shape[0]}): pass the hidden states before the LM "
                  f"head" if logits else f"; {w_name} looks transposed: the LM head is (V, H), the nn.Linear "
                  f"layout (lm_head.weight, not its .T)" if matches_rows else "")
        raise ValueError(f"hidden.shape[-1] = {hidden.shape[-1]} must equal {w_name}.shape[1] = {weight.shape[1]}"
                         f"{layout}")
    if weight.device != hidden.device:
        raise ValueError(f"{w_name} is on {weight.device} but hidden is on {hidden.device}")
    if probs:   # a probability target's dtype and shape: ce/checks.check_probs
        if target.device != hidden.device:
            raise ValueError(f"target is on {target.device} but hidden is on {hidden.device}")
    else:
        check_target(target, hidden.shape[:-1], hidden.device,
                     lambda shape: swapped_hint(tuple(hidden.shape), tuple(weight.shape), shape), probabilities,
                     data="hidden")
    check_vector(b_name, bias, weight.shape[0], hidden.device, position="fourth" if b_name == "bias" else "")
    check_vector(cw_name, ce_weight, weight.shape[0], hidden.device, constant=True)
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(f"hidden, {w_name} and {b_name} must share a dtype; got {hidden.dtype}, "
                        f"{weight.dtype}{'' if bias is None else ', ' + str(bias.dtype)}")
    check_chunk_size(chunk_size)
    check_accum_dtype(accum_dtype)
    if accum_dtype != weight.dtype and torch.finfo(accum_dtype).bits <= torch.finfo(weight.dtype).bits:
        raise ValueError(f"accum_dtype {accum_dtype} is narrower than {w_name}'s {weight.dtype}: the {w_name} "
                         f"gradient would be summed in less precision (or range) than it is returned; pass "
                         f"accum_dtype=torch.float32 (the default) or {weight.dtype}")


def check_num_items(num_items_in_batch, device: torch.device) -> None:
    """``num_items_in_batch``: None, a finite number >= 0, or a one-element real tensor on ``device`` or the CPU."""
    if num_items_in_batch is None:
        return
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.dtype == torch.bool or num_items_in_batch.is_complex():
            raise TypeError(f"num_items_in_batch must be a real number or tensor, got a tensor of dtype "
                            f"{num_items_in_batch.dtype}")
        if num_items_in_batch.requires_grad:   # a constant of the loss, as the loss options
            raise TypeError("num_items_in_batch is a constant of the loss: a tensor that requires grad is not "
                            "supported")
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must be a number or a one-element tensor, got shape "
                             f"{tuple(num_items_in_batch.shape)}")
        if num_items_in_batch.device not in (device, torch.device("cpu")):
            raise ValueError(f"num_items_in_batch is on {num_items_in_batch.device} but the data is on {device}")
        if num_items_in_batch.device.type == "cpu" and host_readable(num_items_in_batch):
            value = float(num_items_in_batch)   # a CPU tensor: reading it syncs with no device
            if not (finite(value) and value >= 0):
                raise ValueError(f"num_items_in_batch must be a finite number >= 0, got {value}")
            fp32_range("num_items_in_batch", value, FP32_NORMAL[0])
        return
    number = isinstance(num_items_in_batch, (numbers.Real,) + SYMBOLIC)
    if isinstance(num_items_in_batch, bool) or not number:
        raise TypeError(f"num_items_in_batch must be a number, a one-element tensor or None, got "
                        f"{num_items_in_batch!r} ({type(num_items_in_batch).__name__})")
    if not (finite(num_items_in_batch) and num_items_in_batch >= 0):
        raise ValueError(f"num_items_in_batch must be a finite number >= 0, got {num_items_in_batch}")
    if not isinstance(num_items_in_batch, SYMBOLIC):
        fp32_range("num_items_in_batch", float(num_items_in_batch), FP32_NORMAL[0])
