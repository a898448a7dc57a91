"""The bits of a representative set of public calls (outputs and gradients), pinned against
``pinned_bits.json``, written once from main 70bf774 before the shared LM-head layer was rebuilt (issue 43):
a refactor of the internals must leave every one of them bit for bit.

Regenerate (only when a result is meant to change, and say so in the commit):
``FUSEDCE_WRITE_PINNED=1 python -m pytest -q tests/pinned/test_pinned_bits.py``.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

import fusedce
from fusedce import distributed
from fusedce.nn import functional as fused_functional

EXPECTED = Path(__file__).with_name("pinned_bits.json")
WRITE = os.environ.get("FUSEDCE_WRITE_PINNED") == "1"
BT, H, V = 12, 16, 40


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    head = f"{t.dtype}{tuple(t.shape)}".encode()
    return hashlib.sha256(head + t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:24]


def _inputs(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BT, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / 4).to(dtype).requires_grad_()
    bias = (torch.randn(V, generator=g) / 8).to(dtype).requires_grad_()
    target = torch.randint(0, V, (BT,), generator=g)
    target[::5] = -100
    probs = torch.softmax(torch.randn(BT, V, generator=g), -1)
    token_w = torch.rand(BT, generator=g) + 0.5
    class_w = torch.rand(V, generator=g) + 0.5
    logits = (torch.randn(BT, V, generator=g) * 2).to(dtype).requires_grad_()
    teacher = torch.randn(BT, V, generator=g)
    return dict(hidden=hidden, weight=weight, bias=bias, target=target, probs=probs, token_w=token_w,
                class_w=class_w, logits=logits, teacher=teacher)


def _run(fn, leaves, **extra):
    """Outputs and the gradients of ``leaves`` under a fixed, non-uniform upstream gradient."""
    out = fn()
    parts = dict(extra)
    tensors = out if isinstance(out, tuple) else (out,)
    loss = tensors[0]
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor):
            parts[f"out{i}"] = t
    if loss.requires_grad:
        g = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape) if loss.dim() else torch.tensor(0.75)
        grads = torch.autograd.grad(loss, leaves, g, allow_unused=True)
        for i, gr in enumerate(grads):
            if gr is not None:
                parts[f"grad{i}"] = gr
    return {k: _digest(v) for k, v in parts.items()}


def _cases():
    c = {}
    for backend in ("torch", "triton"):
        for reduction in ("mean", "sum", "none"):
            c[f"ce/{backend}/{reduction}"] = (backend, lambda x, b=backend, r=reduction: _run(
                lambda: fusedce.cross_entropy(x["logits"], x["target"], reduction=r, backend=b), [x["logits"]]))
        c[f"ce/{backend}/options"] = (backend, lambda x, b=backend: _run(
            lambda: tuple(fusedce.cross_entropy(
                x["logits"], x["target"], x["class_w"], label_smoothing=0.1, lse_square_scale=1e-3, softcap=20.0,
                token_weights=x["token_w"], backend=b, return_stats=True)), [x["logits"]]))
        c[f"ce/{backend}/probs"] = (backend, lambda x, b=backend: _run(
            lambda: tuple(fusedce.cross_entropy(x["logits"], x["probs"], x["class_w"], label_smoothing=0.05,
                                                lse_square_scale=1e-3, backend=b, return_stats=True)), [x["logits"]]))
        c[f"ce/{backend}/token_scaling"] = (backend, lambda x, b=backend: _run(
            lambda: fusedce.cross_entropy(x["logits"], x["target"], use_token_scaling=True, backend=b),
            [x["logits"]]))
    leaves = lambda x: [x["hidden"], x["weight"], x["bias"]]  # noqa: E731
    for backend in ("torch", "triton"):
        for method in ("chunked", "tiled"):
            for reduction in ("mean", "none"):
                c[f"linear/{backend}/{method}/{reduction}"] = (
                    backend, lambda x, b=backend, m=method, r=reduction: _run(
                    lambda: tuple(fusedce.linear_cross_entropy(
                        x["hidden"], x["weight"], x["target"], x["bias"], reduction=r, method=m, backend=b,
                        chunk_size=5 if m == "chunked" else None, return_stats=True)), leaves(x)))
            c[f"linear/{backend}/{method}/options"] = (backend, lambda x, b=backend, m=method: _run(
                lambda: fusedce.linear_cross_entropy(
                    x["hidden"], x["weight"], x["target"], x["bias"], ce_weight=x["class_w"], label_smoothing=0.1,
                    lse_square_scale=1e-3, softcap=15.0, token_weights=x["token_w"], method=m, backend=b),
                leaves(x)))
            c[f"linear/{backend}/{method}/probs"] = (backend, lambda x, b=backend, m=method: _run(
                lambda: tuple(fusedce.linear_cross_entropy(
                    x["hidden"], x["weight"], x["probs"], x["bias"], ce_weight=x["class_w"], label_smoothing=0.1,
                    token_weights=x["token_w"], method=m, backend=b, return_stats=True)), leaves(x)))
            c[f"linear/{backend}/{method}/probs_none"] = (backend, lambda x, b=backend, m=method: _run(
                lambda: fusedce.linear_cross_entropy(x["hidden"], x["weight"], x["probs"], reduction="none",
                                                     method=m, backend=b), leaves(x)))
        c[f"linear/{backend}/invariant"] = (backend, lambda x, b=backend: _run(
            lambda: fusedce.linear_cross_entropy(x["hidden"], x["weight"], x["target"], batch_invariant=True,
                                                 reduction="none", backend=b), leaves(x)))
        c[f"linear/{backend}/bf16"] = (backend, lambda x, b=backend: _run(
            lambda: fusedce.linear_cross_entropy(x["hidden"], x["weight"], x["target"], x["bias"], backend=b),
            leaves(x)))
        c[f"logprobs/{backend}"] = (backend, lambda x, b=backend: _run(
            lambda: tuple(fusedce.token_log_probs(x["logits"], x["target"], temperature=0.7, return_entropy=True,
                                                  backend=b)), [x["logits"]]))
        c[f"linear_logprobs/{backend}"] = (backend, lambda x, b=backend: _run(
            lambda: tuple(fusedce.linear_token_log_probs(x["hidden"], x["weight"], x["target"], x["bias"],
                                                         temperature=0.7, return_entropy=True, chunk_size=5,
                                                         backend=b)), leaves(x)))
        c[f"linear_logprobs_k/{backend}"] = (backend, lambda x, b=backend: _run(
            lambda: fusedce.linear_token_log_probs(x["hidden"], x["weight"],
                                                   torch.stack([x["target"].clamp(min=0), x["target"].flip(0)], -1),
                                                   backend=b), leaves(x)))
        c[f"distill/{backend}"] = (backend, lambda x, b=backend: _run(
            lambda: fusedce.distillation_loss(x["logits"], x["teacher"], x["target"], beta=0.5, temperature=2.0,
                                              hard_label_weight=0.3, backend=b), [x["logits"]]))
        c[f"linear_distill/{backend}"] = (backend, lambda x, b=backend: _run(
            lambda: fusedce.linear_distillation_loss(x["hidden"], x["weight"], x["hidden"].detach() * 0.5,
                                                     x["weight"].detach().flip(0), x["target"], beta=0.0,
                                                     hard_label_weight=0.5, chunk_size=5, backend=b), leaves(x)))
    c["nn/linear_cross_entropy"] = ("torch", lambda x: _run(
        lambda: fused_functional.linear_cross_entropy(x["hidden"], x["weight"], x["target"],
                                                      linear_bias=x["bias"], label_smoothing=0.1), leaves(x)))
    c["nn/linear_cross_entropy_probs"] = ("torch", lambda x: _run(
        lambda: fused_functional.linear_cross_entropy(x["hidden"], x["weight"], x["probs"], reduction="sum"),
        leaves(x)))
    c["module/LinearCrossEntropyLoss"] = ("torch", lambda x: _run(
        lambda: fusedce.LinearCrossEntropyLoss(label_smoothing=0.1, reduction="sum")(
            x["hidden"], x["weight"], x["target"], x["bias"]), leaves(x)))
    c["module/CrossEntropyLoss"] = ("torch", lambda x: _run(
        lambda: fusedce.CrossEntropyLoss(lse_square_scale=1e-3)(x["logits"], x["target"]), [x["logits"]]))
    c["dist/ce"] = ("group", lambda x: _run(
        lambda: tuple(distributed.vocab_parallel_cross_entropy(x["logits"], x["target"], x["class_w"],
                                                               label_smoothing=0.1, backend="torch",
                                                               return_stats=True)), [x["logits"]]))
    c["dist/ce_probs"] = ("group", lambda x: _run(
        lambda: distributed.vocab_parallel_cross_entropy(x["logits"], x["probs"], reduction="none",
                                                         backend="torch"), [x["logits"]]))
    c["dist/linear"] = ("group", lambda x: _run(
        lambda: tuple(distributed.vocab_parallel_linear_cross_entropy(
            x["hidden"], x["weight"], x["target"], x["bias"], lse_square_scale=1e-3, token_weights=x["token_w"],
            chunk_size=5, backend="torch", return_stats=True)), leaves(x)))
    c["dist/linear_probs"] = ("group", lambda x: _run(
        lambda: distributed.vocab_parallel_linear_cross_entropy(x["hidden"], x["weight"], x["probs"], x["bias"],
                                                                chunk_size=5, backend="torch"), leaves(x)))
    return c


CASES = _cases()


def _compute(name: str, request) -> dict:
    need, fn = CASES[name]
    if need == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the pinned Triton bits are the interpreter's (CPU tensors)")
    if need == "group":
        request.getfixturevalue("group")
    dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
    return fn(_inputs(sorted(CASES).index(name), dtype))


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: the CPU reductions' order, so the bits, do not depend on the machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def expected():
    if WRITE:
        found = {}
        yield found
        EXPECTED.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    else:
        yield json.loads(EXPECTED.read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_pinned_bits(name, expected, request):
    got = _compute(name, request)
    if WRITE:
        expected[name] = got
        return
    assert got == expected[name], f"{name}: the bits of these outputs changed: " + ", ".join(
        k for k in got if got[k] != expected[name].get(k))
