"""Random test inputs (never zeros) and the one call wrapper every test goes through."""
from __future__ import annotations

from typing import Optional, Sequence

import pytest
import torch

import fusedce

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
INDEX_DTYPES = (torch.int64, torch.int32)
INDEX_IDS = {torch.int64: "i64", torch.int32: "i32"}


def make_logits(shape: Sequence[int], dtype: torch.dtype = torch.float32, scale: float = 2.0,
                requires_grad: bool = True) -> torch.Tensor:
    """``randn * scale`` in float32, rounded once to ``dtype``: a spread softmax with a clear argmax."""
    x = (torch.randn(*shape, dtype=torch.float32) * scale).to(dtype)
    return x.requires_grad_(requires_grad)


def make_target(shape: Sequence[int], n_classes: int, dtype: torch.dtype = torch.int64,
                ignore_every: int = 0, ignore_index: int = -100) -> torch.Tensor:
    """Random classes in [0, V); every ``ignore_every``-th element (flat order, starting at 1) ignored.

    The first and last classes are forced into the first two rows (when there are that many), so the
    kernels' first and last vocabulary blocks are both hit through the target gather.
    """
    t = torch.randint(0, n_classes, tuple(shape), dtype=torch.int64).reshape(-1)
    if t.numel() >= 2:
        t[0], t[1] = 0, n_classes - 1
    if ignore_every:
        t[1::ignore_every] = ignore_index
    return t.reshape(tuple(shape)).to(dtype)


def make_weight(n_classes: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Class weights in [0.25, 2.25): far from 1 so a forgotten weight changes the answer."""
    return (torch.rand(n_classes) * 2.0 + 0.25).to(dtype)


def bit_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaN payloads included), unlike torch.equal which fails on NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(as_int), b.contiguous().view(as_int)
    return torch.equal(a, b)


def call(logits, target, weight=None, *, backend: str, **kw):
    """``fusedce.cross_entropy`` with an explicit backend (tests never rely on the environment)."""
    return fusedce.cross_entropy(logits, target, weight, backend=backend, **kw)


def loss_and_grad(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None, *,
                  backend: str, upstream=None, **kw):
    """Forward + backward through the public function; returns ``(loss, grad)`` (grad via autograd.grad,
    exactly what autograd hands to ``logits``). ``upstream`` as in reference64 (None, float, tensor)."""
    out = call(logits, target, weight, backend=backend, **kw)
    loss = out.loss if isinstance(out, fusedce.CrossEntropyOutput) else out
    if upstream is None:
        up = torch.ones_like(loss)
    elif isinstance(upstream, torch.Tensor):
        up = upstream
    else:
        up = torch.full_like(loss, float(upstream))
    (grad,) = torch.autograd.grad(loss, logits, up)
    return loss.detach(), grad


# ---------------------------------------------------------------------------------------------------
# Poisoned allocations: whatever the code under test allocates with torch.empty* starts as NaN (floats)
# or INT_POISON (int32/int64), so an output element the kernels never write cannot pass as a zero.
# (torch.empty's contents are unspecified; on CPU they are often fresh zero pages, which would hide
# a missing write of an "ignored row = 0" result.)
INT_POISON = -123456789


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype in (torch.int32, torch.int64):
        t.fill_(INT_POISON)
    return t


class poisoned_allocations:
    """Context manager patching torch.empty, empty_like, empty_strided and Tensor.new_empty."""

    def __enter__(self):
        self.mp = pytest.MonkeyPatch()
        for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch, "empty_strided"),
                            (torch.Tensor, "new_empty")):
            original = getattr(owner, name)

            def wrapper(*args, __original=original, **kwargs):
                return _poison(__original(*args, **kwargs))

            self.mp.setattr(owner, name, wrapper)
        return self

    def __exit__(self, *exc):
        self.mp.undo()
        return False


def check_against_reference(logits: torch.Tensor, target: torch.Tensor, weight=None, *, backend: str,
                            upstream=None, poison: bool = True, **opts):
    """Forward + backward through ``fusedce.cross_entropy`` (allocations poisoned) vs reference64.

    Checks the loss and the gradient with the tolerance table, that ignored rows get exactly zero
    gradient, and for ``reduction="none"`` exactly 0.0 loss (no NaN, no leftover). Returns
    ``(ref, loss, grad)``. The reference is computed first: ``inplace_backward`` destroys ``logits``.
    """
    from reference64 import reference_cross_entropy
    from tolerances import assert_grad_close, assert_loss_close

    ref_opts = {k: v for k, v in opts.items() if k not in ("inplace_backward", "return_stats")}
    ref = reference_cross_entropy(logits, target, weight, upstream=upstream, **ref_opts)
    if poison:
        with poisoned_allocations():
            loss, grad = loss_and_grad(logits, target, weight, backend=backend, upstream=upstream, **opts)
    else:
        loss, grad = loss_and_grad(logits, target, weight, backend=backend, upstream=upstream, **opts)
    assert_loss_close(loss, ref, logits.dtype)
    assert tuple(grad.shape) == tuple(logits.shape), f"grad shape {tuple(grad.shape)} != {tuple(logits.shape)}"
    assert_grad_close(grad, ref, logits.dtype)
    ignored = target == opts.get("ignore_index", -100)
    if bool(ignored.any()):
        assert bool((grad[ignored] == 0).all()), "ignored rows must get exactly zero gradient"
        if opts.get("reduction", "mean") == "none":
            assert bool((loss[ignored] == 0).all()), f"ignored rows' loss must be 0.0, got {loss[ignored]}"
    return ref, loss, grad
