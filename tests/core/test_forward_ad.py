"""Forward-mode AD (issue 27, item 1): every public tensor op refuses a forward-mode tangent with an error
naming fusedce, the op and forward-mode AD, on both backends (Triton under the interpreter), for
``torch.func.jvp`` and ``torch.autograd.forward_ad`` alike. Before, the Triton cross-entropy, the probability
targets (both backends) and the Triton distillation returned a zero (or None) tangent without a word.
A call without a tangent inside an open dual level runs as outside.

Inputs: ``public_ops.make_inputs`` (10 tokens, H = 12, V = 37); the tangent is taken along the op's
first differentiable input (logits, or hidden states for the linear ops).
"""
from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fusedce
from public_ops import BT, CALLS, V, make_inputs, with_logits

FORWARD_AD = r"forward-mode AD .* not supported by fusedce"


def _case(name):
    kind, call = CALLS[name]
    x = with_logits(make_inputs())
    key = "logits" if kind == "logits" else "hidden"
    return call, x, key


def _skip_drop_in(name, backend):
    if name.startswith("fusedce.nn.") and backend != "torch":
        pytest.skip("torch's drop-in takes no backend (the default backend: torch on CPU)")


@pytest.mark.parametrize("name", sorted(CALLS))
def test_jvp_is_refused_on_every_op(name, backend):
    _skip_drop_in(name, backend)
    call, x, key = _case(name)
    primal = x[key].detach()

    def f(p):
        return call({**x, key: p}, backend)

    with pytest.raises(NotImplementedError, match=FORWARD_AD) as info:
        torch.func.jvp(f, (primal,), (torch.randn_like(primal),))
    assert name in str(info.value)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_forward_ad_dual_is_refused_on_every_op(name, backend):
    _skip_drop_in(name, backend)
    call, x, key = _case(name)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x[key].detach(), torch.randn_like(x[key]))
        with pytest.raises(NotImplementedError, match=FORWARD_AD):
            call({**x, key: dual}, backend)


SOFT_AND_METHODS = {
    "probability targets": lambda z, w, q, b: fusedce.cross_entropy(z @ w.t(), q, backend=b),
    "linear probability targets (chunked)": lambda h, w, q, b: fusedce.linear_cross_entropy(
        h, w, q, method="chunked", backend=b),
    "linear cross-entropy (tiled)": lambda h, w, q, b: fusedce.linear_cross_entropy(
        h, w, q.argmax(-1), method="tiled", backend=b),
    "linear cross-entropy (chunked)": lambda h, w, q, b: fusedce.linear_cross_entropy(
        h, w, q.argmax(-1), method="chunked", backend=b),
    "linear distillation (tiled)": lambda h, w, q, b: fusedce.linear_distillation_loss(
        h, w, h.detach(), w.detach() * 0.5, q.argmax(-1), method="tiled", backend=b),
}


@pytest.mark.parametrize("case", sorted(SOFT_AND_METHODS))
def test_jvp_is_refused_for_probability_targets_and_every_method(case, backend):
    h, w = torch.randn(BT, 12), torch.randn(V, 12) * 0.5
    q = torch.softmax(torch.randn(BT, V), -1)
    fn = SOFT_AND_METHODS[case]
    with pytest.raises(NotImplementedError, match=FORWARD_AD):
        torch.func.jvp(lambda a: fn(a, w, q, backend), (h,), (torch.randn_like(h),))
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match=FORWARD_AD):
            fn(h, fwAD.make_dual(w, torch.randn_like(w)), q, backend)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_call_without_tangent_inside_a_dual_level_runs(name, backend):
    """The refusal looks at the arguments, not at the open dual level: a call whose inputs carry no
    tangent (e.g. a loss on constants inside a forward-mode region) runs and equals the call outside."""
    _skip_drop_in(name, backend)
    if name.startswith("fusedce.distributed."):
        pytest.skip("needs a process group (tests/core/test_entrance.py runs these on one)")
    call, x, key = _case(name)
    const = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
    want = call(const, backend)
    with fwAD.dual_level():
        got = call(const, backend)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
