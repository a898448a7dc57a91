"""A ``backward()`` called INSIDE a ``torch.autocast`` region gives the same gradients (values bitwise,
dtypes) as the same graph's backward called outside it.

Autograd replays the caller's autocast state on the backward formulas; stock's backward of an op
recorded under autocast is fixed by the forward's dtypes, so a user may call ``loss.backward()`` inside
or outside the ``with`` block. Before ``core.autocast.backward_formula``, the tiled method's backward
re-formed its logits tiles under autocast (bf16 tiles against an fp32 gradient) and raised
``scatter(): Expected self.dtype to be equal to src.dtype``; soft targets and the tail of top-k
distillation silently differed by ~5e-4.

Every public tensor op (``tests/support/public_ops.py``, so a new op is covered), and the linear ops by hand with
each method (chunked, tiled), hard and soft targets, with entropy, the top-k tail, both backends.
Autocast bf16 and fp16 on CPU; fp32 leaves (the forward's casts are autocast's own).
"""
from __future__ import annotations

import pytest
import torch

import fusedce
from public_ops import CALLS, make_inputs, with_logits

LEAVES = ("hidden", "weight", "bias")
AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _total(outs):
    """A scalar of every differentiable output, weighted so that no gradient is a plain sum."""
    return sum((o.float() * (1 + torch.arange(o.numel()).reshape(o.shape) % 3)).sum()
               for o in outs if isinstance(o, torch.Tensor) and o.requires_grad)


def _both(forward, amp):
    """``(outputs, grads)`` of ``forward()`` under autocast ``amp``, backward outside and inside."""
    results = []
    for inside in (False, True):
        leaves, outs = forward()
        with torch.autocast("cpu", dtype=amp):
            outs = outs()
            if inside:
                grads = torch.autograd.grad(_total(outs), leaves, allow_unused=True)
        if not inside:
            grads = torch.autograd.grad(_total(outs), leaves, allow_unused=True)
        results.append((outs, grads))
    return results


def _assert_same(results):
    (outs_a, grads_a), (outs_b, grads_b) = results
    for a, b in zip(outs_a, outs_b):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for i, (a, b) in enumerate(zip(grads_a, grads_b)):
        assert (a is None) == (b is None), f"gradient {i}: present in one run only"
        if a is not None:
            assert a.dtype == b.dtype, f"gradient {i}: {a.dtype} outside, {b.dtype} inside"
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"gradient {i}: {m}")


@pytest.mark.parametrize("amp", list(AMP))
@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_public_op(name, backend, amp, group):
    if name.startswith("fusedce.nn.") and backend != "torch":
        pytest.skip("torch's drop-in takes no backend")
    kind, call = CALLS[name]
    base = make_inputs()

    def forward():
        x = {k: (v.detach().clone().requires_grad_() if k in LEAVES else v) for k, v in base.items()}
        leaves = [x[k] for k in LEAVES]
        return leaves, (lambda: call(with_logits(x) if kind == "logits" else x, backend))

    _assert_same(_both(forward, AMP[amp]))


N, H, V, K = 12, 16, 40, 4


def _linear_ops(m, b):
    t = torch.randint(0, V, (N,))
    t[3] = -100
    soft = torch.softmax(torch.randn(N, V), -1)
    ids = torch.stack([torch.randperm(V)[:K] for _ in range(N)])
    tlp = torch.log_softmax(torch.randn(N, K), -1) - 0.1
    th, tw = torch.randn(N, H), torch.randn(V, H) * 0.3
    return {
        "hard": lambda h, w, bias: (fusedce.linear_cross_entropy(
            h, w, t, bias, method=m, backend=b, label_smoothing=0.1, reduction="none"),),
        "soft": lambda h, w, bias: (fusedce.linear_cross_entropy(h, w, soft, bias, method=m, backend=b),),
        "module": lambda h, w, bias: (fusedce.LinearCrossEntropyLoss(method=m, backend=b)(h, w, t, bias),),
        "log_probs": lambda h, w, bias: tuple(fusedce.linear_token_log_probs(
            h, w, t, bias, method=m, backend=b, return_entropy=True)),
        "topk_tail": lambda h, w, bias: (fusedce.linear_topk_distillation_loss(
            h, w, ids, tlp, t, student_bias=bias, method=m, backend=b, hard_label_weight=0.5, tail=True),),
        "distill": lambda h, w, bias: (fusedce.linear_distillation_loss(
            h, w, th, tw, t, student_bias=bias, method=m, backend=b, beta=0.5, hard_label_weight=0.5),),
    }


@pytest.mark.parametrize("op", ["hard", "soft", "module", "log_probs", "topk_tail", "distill"])
@pytest.mark.parametrize("method", ["chunked", "tiled"])
@pytest.mark.parametrize("amp", list(AMP))
def test_linear_ops_each_method(op, method, backend, amp):
    fn = _linear_ops(method, backend)[op]
    h0, w0, b0 = torch.randn(N, H), torch.randn(V, H) * 0.3, torch.randn(V) * 0.1

    def forward():
        leaves = [x.clone().requires_grad_() for x in (h0, w0, b0)]
        return leaves, (lambda: fn(*leaves))

    _assert_same(_both(forward, AMP[amp]))
