"""The value check of probability ("soft") targets (issue 30): a negative, NaN or +inf probability is a
``ValueError`` naming ``target`` and the first bad position, raised before anything is written, on every
single-process op that takes a float target (``cross_entropy``, ``linear_cross_entropy`` chunked and
tiled, ``fusedce.nn.functional.linear_cross_entropy``, both modules), both backends; what torch accepts
(exact zeros, -0.0, values above 1, rows not summing to 1) still passes; under torch.compile the check is
skipped (the target-range check's rule) and a NaN reaches the loss instead of an error.

Shapes: (2, 3) rows x V = 75 classes (odd), H = 16; the bad value sits at [1, 2, 7] (the last row, not
the first element, so the reported position is the one found, not a default; [5, 7] for the drop-in's
2-D torch layout).
"""
from __future__ import annotations

import pytest
import torch

import fusedce
import fusedce.nn.functional as FF

LEAD, V, H = (2, 3), 75, 16
BAD_AT = (1, 2, 7)
BAD_VALUES = {"negative": -1e-3, "nan": float("nan"), "minus-inf": float("-inf"), "plus-inf": float("inf")}


def _target(q_dtype=torch.float32):
    return torch.softmax(torch.randn(*LEAD, V) * 2.0, dim=-1).to(q_dtype)


def _ops(backend):
    """name -> call(target): every single-process entry point with a probability target."""
    logits = torch.randn(*LEAD, V, requires_grad=True)
    hidden = torch.randn(*LEAD, H, requires_grad=True)
    weight = (torch.randn(V, H) * 0.3).requires_grad_()
    return {
        "cross_entropy": lambda q: fusedce.cross_entropy(logits, q, backend=backend),
        "cross_entropy-inplace": lambda q: fusedce.cross_entropy(logits.detach().clone(), q, backend=backend,
                                                                 inplace_backward=True),
        "linear-chunked": lambda q: fusedce.linear_cross_entropy(hidden, weight, q, method="chunked",
                                                                 backend=backend),
        "linear-tiled": lambda q: fusedce.linear_cross_entropy(hidden, weight, q, method="tiled",
                                                               backend=backend),
        # torch's layout: 2-D input (N, H) and target (N, V); [1, 2, 7] is row 5 there
        "nn.functional": lambda q: FF.linear_cross_entropy(hidden.reshape(-1, H), weight, q.reshape(-1, V)),
        "CrossEntropyLoss": lambda q: fusedce.CrossEntropyLoss(backend=backend)(logits, q),
        "LinearCrossEntropyLoss": lambda q: fusedce.LinearCrossEntropyLoss(backend=backend)(hidden, weight, q),
    }, (logits, hidden, weight)


OP_NAMES = list(_ops("torch")[0])


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["q-fp32", "q-bf16"])
@pytest.mark.parametrize("kind", list(BAD_VALUES))
@pytest.mark.parametrize("op", OP_NAMES)
def test_bad_probability_is_a_value_error_naming_target(backend, op, kind, q_dtype):
    calls, leaves = _ops(backend)
    q = _target(q_dtype)
    q[BAD_AT] = BAD_VALUES[kind]
    q_before = q.clone()
    before = [t.detach().clone() for t in leaves]
    at = r"\[5, 7\]" if op == "nn.functional" else r"\[1, 2, 7\]"
    with pytest.raises(ValueError, match=r"target" + at + r" = .*class probabilities.*>= 0 and not NaN"):
        calls[op](q)
    assert torch.equal(q.nan_to_num(), q_before.nan_to_num()), "the caller's target was modified"
    assert all(torch.equal(t.detach(), b) for t, b in zip(leaves, before))
    assert all(t.grad is None for t in leaves)


@pytest.mark.parametrize("op", OP_NAMES)
def test_what_torch_accepts_still_passes(backend, op):
    """Zeros, a -0.0, a value above 1 and rows that do not sum to 1: accepted (as torch), a finite loss."""
    calls, _ = _ops(backend)
    q = _target()
    q[0, 0, :5] = 0.0
    q[0, 1, 3] = -0.0
    q[1, 0, 4] = 1.5
    loss = calls[op](q)
    assert torch.isfinite(loss).all()


def test_negative_hint_names_log_probabilities(backend):
    calls, _ = _ops(backend)
    q = _target()
    q[BAD_AT] = -0.25
    with pytest.raises(ValueError, match=r"log-probabilities\? pass their exp\(\)"):
        calls["cross_entropy"](q)


def test_empty_target_is_not_checked(backend):
    loss = fusedce.cross_entropy(torch.randn(0, V, requires_grad=True), torch.empty(0, V), backend=backend)
    assert float(loss.detach()) == 0.0


def test_skipped_under_compile():
    """torch.compile: no host sync, so no check; the NaN reaches the loss (never silently 0)."""
    torch._dynamo.reset()
    logits = torch.randn(*LEAD, V)
    q = _target()
    q[BAD_AT] = float("nan")

    def step(x, t):
        return fusedce.cross_entropy(x, t, backend="torch")

    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(logits, q)
    torch._dynamo.reset()
    assert torch.isnan(loss)
    with pytest.raises(ValueError, match=r"target\[1, 2, 7\]"):
        step(logits, q)   # eager: the check runs


@pytest.mark.parametrize("op", ["cross_entropy", "linear_chunked", "linear_tiled"])
def test_a_non_finite_token_weight_with_probability_targets_is_a_value_error(op):
    """Probability targets keep every row, so a NaN / inf token weight is an error, in the value check's one
    host sync (before: a silent NaN loss, where class-index targets raised)."""
    h, W = torch.randn(6, 4), torch.randn(10, 4)
    q = torch.softmax(torch.randn(6, 10), dim=-1)
    for bad in (float("nan"), float("inf")):
        tw = torch.ones(6)
        tw[2] = bad
        with pytest.raises(ValueError, match=r"token_weights\[2\]"):
            if op == "cross_entropy":
                fusedce.cross_entropy(h @ W.t(), q, token_weights=tw)
            else:
                fusedce.linear_cross_entropy(h, W, q, token_weights=tw, method=op.split("_")[1])
