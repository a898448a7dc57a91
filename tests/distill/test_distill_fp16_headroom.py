"""fp16 distillation whose per-logit gradients are not bounded like cross-entropy's (issue 27 item 4): the
reverse KL (``beta = 1``) with a teacher whose log-probs fall far below the student's (logits ~ N(0, 50^2)
through the head) has ``|dL/du|`` in the hundreds; its mean / sum gradients made in the forward times the
headroom ``P`` overflowed fp16 (``inf`` entries in the hidden gradient where float64's largest is ~7). Every
backend and method: finite, and within fp16's rounding of float64 (``distill/linear_head.headroom_holds``).
The JSD (``beta = 0.5``) and the forward KL keep their forward-made gradients and are checked the same way."""
from __future__ import annotations

import pytest
import torch

import fusedce

N, H, V = 32, 128, 2000


def _inputs():
    g = torch.Generator().manual_seed(0)
    hs = (torch.randn(N, H, generator=g) * 2).half()
    ws = (torch.randn(V, H, generator=g) * 0.5).half()
    ht = (torch.randn(N, H, generator=g) * 50).half()
    wt = (torch.randn(V, H, generator=g) * 0.5).half()
    return hs, ws, ht, wt


def _reference(hs, ws, ht, wt, beta, reduction):
    h64 = hs.double().requires_grad_()
    ls = (h64 @ ws.double().T).log_softmax(-1)
    lt = (ht.double() @ wt.double().T).log_softmax(-1)
    if beta == 1.0:
        rows = (ls.exp() * (ls - lt)).sum(-1)
    elif beta == 0.0:
        rows = (lt.exp() * (lt - ls)).sum(-1)
    else:
        lm = torch.logaddexp(ls + torch.log1p(torch.tensor(-beta, dtype=torch.float64)),
                             lt + torch.log(torch.tensor(beta, dtype=torch.float64)))
        rows = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    (rows.mean() if reduction == "mean" else rows.sum()).backward()
    return h64.grad


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("beta", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("method", ["chunked", "tiled"])
def test_fp16_hidden_gradient_is_finite_and_right(backend, method, beta, reduction):
    if backend == "triton" and (method == "tiled" or reduction == "sum") and beta != 1.0:
        pytest.skip("the Triton interpreter: the reverse KL (the case that overflowed) on every method and "
                    "reduction, the others chunked + mean")
    hs, ws, ht, wt = _inputs()
    ref = _reference(hs, ws, ht, wt, beta, reduction)
    h = hs.clone().requires_grad_()
    fusedce.linear_distillation_loss(h, ws, ht, wt, beta=beta, method=method, reduction=reduction,
                                     backend=backend).backward()
    assert bool(torch.isfinite(h.grad).all()), f"non-finite hidden gradient ({int((~torch.isfinite(h.grad)).sum())})"
    # fp16 rounding of the result (half an ulp, 2^-11 relative) plus fp32 math on O(1e3) log-ratios. The
    # JSD's true gradient here is ~1e-7 (below fp16's normal range): it is the difference of per-class terms
    # ~0.35 that cancel, so fp32 math leaves ~1e-6 absolute (as fp32 autograd of the stock composition
    # would); it is held to that absolute level, the KLs to the relative bound.
    bound = 2.0 ** -10 * ref.abs() + 2.0 ** -12 * float(ref.abs().max())
    if 0.0 < beta < 1.0:
        bound = bound + 4e-6
    diff = (h.grad.double() - ref).abs()
    assert bool((diff <= bound).all()), \
        f"max |diff| {float(diff.max()):.2e} (largest entry {float(ref.abs().max()):.2e})"
