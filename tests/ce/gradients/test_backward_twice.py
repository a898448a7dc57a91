"""Backward more than once (case C16, docs/cases.md): every op and reduction gives torch's result for
a second backward through a retained graph (``retain_graph=True`` then ``backward``; or
``torch.autograd.grad(..., retain_graph=True)`` then ``backward``), as auxiliary losses, gradient
penalties and grad-norm probes do. A double backward (``create_graph=True``) raises a RuntimeError that
names it; a second backward after ``inplace_backward=True`` (which consumed the logits) too.

The expected gradients are those of the same op's single backward (which the rest of the suite checks
against float64), doubled for two ``backward`` calls: the second backward must recompute exactly.
"""
from __future__ import annotations

import pytest
import torch

import fusedce
from inputs import make_logits, make_target, make_weight

REDUCTIONS = ("mean", "sum", "none")
OPTS = dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=20.0)


def _ce_case(reduction):
    x = make_logits((5, 7, 33), torch.float32)
    t = make_target((5, 7), 33, ignore_every=3)
    up = torch.randn(5, 7) if reduction == "none" else torch.tensor(1.3)
    return x, t, make_weight(33), up


def _linear_case(reduction):
    h = torch.randn(4, 9, 12, requires_grad=True)
    w = (torch.randn(37, 12) * 0.3).requires_grad_()
    b = torch.randn(37, requires_grad=True)
    t = make_target((4, 9), 37, ignore_every=4)
    up = torch.randn(4, 9) if reduction == "none" else torch.tensor(0.7)
    return (h, w, b), t, make_weight(37), up


def _ce(x, t, w, backend, reduction, **kw):
    return fusedce.cross_entropy(x, t, w, backend=backend, reduction=reduction, **OPTS, **kw)


def _linear(leaves, t, cw, backend, reduction, module=False):
    h, w, b = leaves
    if module:
        fn = fusedce.LinearCrossEntropyLoss(cw, reduction=reduction, chunk_size=16, backend=backend, **OPTS)
        return fn(h, w, t, b)
    return fusedce.linear_cross_entropy(h, w, t, b, ce_weight=cw, reduction=reduction, chunk_size=16,
                                        backend=backend, **OPTS)


def _close(a, b, name):
    """Equal up to fp32 rounding of the same sums taken with the upstream scale applied at another
    point (the first backward of mean/sum scales gradients made in forward; a recompute folds the scale
    into the kernel): 64 fp32 ulps (2^-18) of the tensor's largest element."""
    bound = 2.0 ** -18 * float(b.abs().max())
    assert float((a - b).abs().max()) <= bound, f"{name}: max |diff| {float((a - b).abs().max()):.3e} > {bound:.3e}"


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_backward_twice(backend, reduction):
    x, t, w, up = _ce_case(reduction)
    once = x.detach().clone().requires_grad_()
    _ce(once, t, w, backend, reduction).backward(up)
    twice = x.detach().clone().requires_grad_()
    loss = _ce(twice, t, w, backend, reduction)
    loss.backward(up, retain_graph=True)
    loss.backward(up)
    _close(twice.grad, 2 * once.grad, "retain_graph twice")
    probe = x.detach().clone().requires_grad_()
    loss = _ce(probe, t, w, backend, reduction)
    (g,) = torch.autograd.grad(loss, probe, up, retain_graph=True)   # a grad-norm probe first
    loss.backward(up)
    _close(g, once.grad, "autograd.grad")
    _close(probe.grad, once.grad, "backward after autograd.grad")


@pytest.mark.parametrize("module", [False, True], ids=["function", "module"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy_backward_twice(backend, reduction, module):
    """C16: ``l.backward(retain_graph=True); l.backward()`` gives 2x the gradients (mean/sum used to
    raise: their gradients were made in forward and scaled in place by the first backward)."""
    leaves, t, cw, up = _linear_case(reduction)
    once = [p.detach().clone().requires_grad_() for p in leaves]
    _linear(once, t, cw, backend, reduction, module).backward(up)
    twice = [p.detach().clone().requires_grad_() for p in leaves]
    loss = _linear(twice, t, cw, backend, reduction, module)
    loss.backward(up, retain_graph=True)
    loss.backward(up)
    for a, b, name in zip(twice, once, ("hidden", "weight", "bias")):
        _close(a.grad, 2 * b.grad, f"{name} after two backwards")
    probe = [p.detach().clone().requires_grad_() for p in leaves]
    loss = _linear(probe, t, cw, backend, reduction, module)
    (g_h,) = torch.autograd.grad(loss, probe[0], up, retain_graph=True)
    loss.backward(up)
    _close(g_h, once[0].grad, "autograd.grad of hidden")
    for a, b, name in zip(probe, once, ("hidden", "weight", "bias")):
        _close(a.grad, b.grad, f"{name} after autograd.grad then backward")


def test_double_backward_raises_naming_it(backend):
    x, t, w, _ = _ce_case("mean")
    x.requires_grad_()
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(_ce(x, t, w, backend, "mean"), x, create_graph=True)
    leaves, t, cw, _ = _linear_case("mean")
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(_linear(leaves, t, cw, backend, "mean"), leaves[0], create_graph=True)


def test_second_backward_after_inplace_backward_raises(backend):
    x, t, w, _ = _ce_case("sum")
    logits = x.detach().clone().requires_grad_()
    buffer = logits * 1.0          # a non-leaf the op may overwrite
    loss = _ce(buffer, t, w, backend, "sum", inplace_backward=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace_backward"):
        loss.backward()
