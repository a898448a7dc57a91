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
