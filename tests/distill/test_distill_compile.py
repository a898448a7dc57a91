"""``linear_distillation_loss`` under ``torch.compile(fullgraph=True)`` (issue 27 item 4): the torch
backend's tiled loop is one custom op (``backends/pytorch/custom_ops.py``; traced, its block loop hit
``torch.is_inference_mode_enabled`` and Dynamo refused the graph), the chunked method traces; compiled
equals eager (loss and the student's gradients), also for a single row (the PyTorch row op's lone-row path)."""
from __future__ import annotations

import pytest
import torch

import fusedce

H, HT, V = 24, 20, 301


@pytest.mark.parametrize("n", [16, 1])
@pytest.mark.parametrize("method", ["tiled", "chunked"])
def test_compiled_equals_eager(method, n):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    hs, ws, bs = torch.randn(n, H, generator=g), torch.randn(V, H, generator=g) * 0.3, torch.randn(V, generator=g)
    ht, wt = torch.randn(n, HT, generator=g), torch.randn(V, HT, generator=g) * 0.3
    target = torch.randint(0, V, (n,), generator=g)
    target[::4] = -100 if n > 1 else target[::4]

    def loss_fn(h, w, b):
        return fusedce.linear_distillation_loss(h, w, ht, wt, target, student_bias=b, beta=0.5, hard_label_weight=0.2,
                                                method=method, backend="torch")

    outs = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (hs, ws, bs)]
        loss = fn(*leaves)
        loss.backward()
        outs.append([loss.detach()] + [t.grad for t in leaves])
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# Top-k distillation with ``tail=True`` (issue 46 item 3): the tail pass's block loops (``distill/tail.py``)
# ran in Python under the autograd Function, and Dynamo refused the graph ("Unsupported:
# torch.is_inference_mode_enabled", from ``launch.run``) on every backend and method; they are custom
# ops now. Each case compiles (``fullgraph=True``, ``dynamic=True``) and runs three token counts (ignored
# tokens, padding entries, a token without a tail among them): compiled = eager, at most one compilation
# beyond the first (the 0/1 specialisation, as ``tests/ce/compile/test_compile_token_counts.py``; the logits form
# also recompiled per count before: the K-class op's ``rl/kclass_head.class_sums`` looped over the tokens).
K, COUNTS = 3, (7, 12, 19)


def _topk_inputs(n: int):
    g = torch.Generator().manual_seed(n)
    hs, ws = torch.randn(n, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    lp, ids = torch.log_softmax(torch.randn(n, V, generator=g) * 2, dim=-1).topk(K, dim=-1)
    lp[1, 2] = float("-inf")                        # a padding entry
    lp[2] = torch.log(torch.tensor([0.5, 0.3, 0.2]))  # a token whose K classes hold all its mass: no tail
    target = torch.randint(0, V, (n,), generator=g)
    target[::4] = -100
    return hs, ws, ids, lp, target


def _topk_step(form: str, method: str, backend: str):
    def logits_step(h, w, ids, lp, target):
        return fusedce.topk_distillation_loss(h @ w.t(), ids, lp, target, tail=True, hard_label_weight=0.3,
                                              temperature=2.0, backend=backend)

    def linear_step(h, w, ids, lp, target):
        return fusedce.linear_topk_distillation_loss(h, w, ids, lp, target, tail=True, hard_label_weight=0.3,
                                                     temperature=2.0, method=method, backend=backend)
    return logits_step if form == "logits" else linear_step


@pytest.mark.parametrize("form, method", [("logits", None), ("linear", "chunked"), ("linear", "tiled")])
def test_topk_tail_compiles_once_for_every_token_count(backend, form, method):
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    step = _topk_step(form, method, backend)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for n in COUNTS:
        hs, ws, ids, lp, target = _topk_inputs(n)
        outs = []
        for fn in (step, compiled):
            leaves = [t.clone().requires_grad_() for t in (hs, ws)]
            loss = fn(*leaves, ids, lp, target)
            loss.backward()
            outs.append([loss.detach()] + [t.grad for t in leaves])
        for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), *outs):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} at {n} tokens: {m}")
    assert counter.frame_count <= 2, (
        f"{counter.frame_count} compilations for {len(COUNTS)} token counts: the graph specializes on the count")
