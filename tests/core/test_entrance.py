"""The one entrance (``core/entrance.py``): every public function goes through ``public_op``, and every
tensor op behaves under ``torch.autocast`` as the stock composition it replaces, found by walking the
public lists (``tests/support/public_ops.py``), so that a new op cannot be missed.

Autocast: a ``"linear"`` op under ``torch.autocast("cpu", dtype)`` must equal the same op called outside
autocast on ``hidden``, ``weight``, ``bias`` (and a teacher's head) cast to ``dtype`` by hand, as autocast
casts ``F.linear``'s inputs (values and gradients of the fp32 leaves: bitwise, the same computation);
inputs: fp32 leaves, and bf16 hidden states with fp32 master weights (ordinary AMP; before the entrance,
``linear_distillation_loss`` raised "must share a dtype" there). A ``"logits"`` op (fp32 logits, and bf16
logits) under autocast must equal the op outside autocast (stock ``F.cross_entropy`` / ``log_softmax`` are on
autocast's fp32 list).
Both backends (Triton under the interpreter); the vocab-parallel ops on a one-rank gloo group.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from fusedce.core.entrance import ENTRANCE, KINDS, public_op
from public_ops import CALLS, PUBLIC_FUNCTIONS, make_inputs, with_logits

LEAVES = ("hidden", "weight", "bias")


def test_public_lists_are_walked():
    """The walk finds the ops of every family (a sanity check of ``public_ops``: not an empty list)."""
    for name in ("fusedce.cross_entropy", "fusedce.linear_distillation_loss", "fusedce.patch_trl",
                 "fusedce.distributed.vocab_parallel_linear_token_log_probs",
                 "fusedce.nn.functional.linear_cross_entropy"):
        assert name in PUBLIC_FUNCTIONS


@pytest.mark.parametrize("name", sorted(PUBLIC_FUNCTIONS))
def test_every_public_function_goes_through_the_entrance(name):
    fn = PUBLIC_FUNCTIONS[name]
    assert getattr(fn, "__fusedce_entrance__", None) in KINDS, f"{name} does not wear @public_op"
    inner = inspect.unwrap(fn)
    assert ENTRANCE[f"{inner.__module__}.{inner.__qualname__}"] == fn.__fusedce_entrance__


def test_every_tensor_op_has_a_call():
    """Every public op that takes tensors has a call in ``public_ops.CALLS`` of its entrance kind, so the
    autocast and DTensor tests below run it; the integrations (patches) are the only others."""
    tensor_ops = {n for n, f in PUBLIC_FUNCTIONS.items() if f.__fusedce_entrance__ != "integration"}
    assert tensor_ops == set(CALLS)
    for name, (kind, _) in CALLS.items():
        assert PUBLIC_FUNCTIONS[name].__fusedce_entrance__ == kind, name


def test_the_entrance_rejects_a_wrong_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        public_op("logit")
    with pytest.raises(ValueError, match="linear= applies"):
        public_op("logits", linear=(("a", "b", "c"),))


def _run(name, x, backend, *, amp=None):
    kind, call = CALLS[name]
    if amp is None:
        return call(x, backend)
    with torch.autocast("cpu", dtype=amp):
        return call(x, backend)


def _grads(outs, leaves):
    total = sum((o.float() * (1 + torch.arange(o.numel()).reshape(o.shape) % 3)).sum()
                for o in outs if o.requires_grad)
    return torch.autograd.grad(total, leaves, allow_unused=True, retain_graph=True)


@pytest.mark.parametrize("inputs", ["fp32_leaves", "bf16_hidden"])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_op_under_autocast_as_stock(name, backend, inputs, group):
    amp = torch.bfloat16
    kind, _ = CALLS[name]
    if name.startswith("fusedce.nn.") and backend != "torch":
        pytest.skip("torch's drop-in takes no backend (the default backend: torch on CPU)")
    x = make_inputs()
    if inputs == "bf16_hidden" and kind == "linear":
        x["hidden"] = x["hidden"].detach().to(amp).requires_grad_()
        x["teacher_hidden"] = x["teacher_hidden"].to(amp)
    leaves = [x[k] for k in LEAVES]
    if kind == "logits":
        y = with_logits(x)
        if inputs == "bf16_hidden":   # low-precision logits (made by a bf16 head), a differentiable cast
            y["logits"], y["teacher_logits"] = y["logits"].to(amp), y["teacher_logits"].to(amp)
        got = _run(name, y, backend, amp=amp)
        want = _run(name, y, backend)
    else:
        got = _run(name, x, backend, amp=amp)
        cast = {k: (v.to(amp) if isinstance(v, torch.Tensor) and v.is_floating_point() and k not in
                    ("teacher_log_probs",) else v) for k, v in x.items()}
        want = _run(name, cast, backend)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for g, w, leaf in zip(_grads(got, leaves), _grads(want, leaves), leaves):
        if w is None:
            assert g is None
            continue
        assert g.dtype == leaf.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)
