"""``logit_scale`` on the four distillation losses (the contract: the logits are first multiplied by it,
before softcap, in every op): the student's scale ``a_s`` (``logit_scale``) and, for the dense losses, the
teacher's ``a_t`` (``teacher_logit_scale``), against the float64 references on the scaled logits
(``reference64_distill.py`` for the dense losses; the top-k formula of ``distill/topk.py`` below), loss and
student gradients, both backends (Triton under the interpreter), both methods of the linear forms.
Scales 0.7 / 1.6 (not powers of two) with softcaps small enough (4.0) that applying the scale after the cap
would be visible; fp32 inputs, the tolerance of ``test_distill_topk_keywords.py``."""
import pytest
import torch

import fusedce
from reference64_distill import distillation_loss64, linear_distillation_loss64

BACKENDS = ["torch", "triton"]
A_S, A_T = 0.7, 1.6
OPTS = dict(beta=0.5, temperature=2.0, hard_label_weight=0.3, student_softcap=4.0, teacher_softcap=4.0)


def _inputs(n=10, h=12, v=40, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs, ws = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / 2
    ht, wt = torch.randn(n, h + 3, generator=g), torch.randn(v, h + 3, generator=g) / 2
    bs = torch.randn(v, generator=g) / 4
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    lp = torch.log_softmax(torch.randn(n, v, generator=g), -1).gather(-1, ids)
    target = torch.randint(0, v, (n,), generator=g)
    target[::3] = -100
    return hs, ws, bs, ht, wt, ids, lp, target


def _close(loss, ref, pairs):
    assert abs(loss.item() - ref.item()) <= 1e-5 * (1 + abs(ref.item())), (loss.item(), ref.item())
    for got, want in pairs:
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_distillation_loss(backend):
    hs, ws, _, ht, wt, _, _, target = _inputs()
    zs, zt = (hs @ ws.T).requires_grad_(True), ht @ wt.T
    loss = fusedce.distillation_loss(zs, zt, target, logit_scale=A_S, teacher_logit_scale=A_T, backend=backend,
                                     **OPTS)
    loss.backward()
    z64 = zs.detach().double().requires_grad_(True)
    ref = distillation_loss64(z64 * A_S, zt.double() * A_T, target, **OPTS)
    ref.backward()
    _close(loss, ref, [(zs.grad, z64.grad)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["chunked", "tiled"])
def test_linear_distillation_loss(backend, method):
    hs, ws, bs, ht, wt, _, _, target = _inputs(seed=1)
    h, w, b = (t.clone().requires_grad_(True) for t in (hs, ws, bs))
    loss = fusedce.linear_distillation_loss(h, w, ht, wt, target, student_bias=b, logit_scale=A_S,
                                            teacher_logit_scale=A_T, method=method, backend=backend, **OPTS)
    loss.backward()
    h64, w64, b64 = (t.double().requires_grad_(True) for t in (hs, ws, bs))
    ref = linear_distillation_loss64(h64 * A_S, w64, ht.double() * A_T, wt.double(), target,
                                     student_bias=b64 * A_S, **OPTS)
    ref.backward()
    _close(loss, ref, [(h.grad, h64.grad), (w.grad, w64.grad), (b.grad, b64.grad)])


def _topk64(zs64, ids, lp, target, temperature, hard_label_weight, softcap):
    """``sum_k p_k (lp_k - log softmax(c(z) / T)[id_k]) + w CE(c(z), target)`` in float64, mean over the
    non-ignored tokens; ``zs64`` already scaled."""
    c = softcap * torch.tanh(zs64 / softcap)
    log_s = torch.log_softmax(c / temperature, -1).gather(-1, ids)
    kl = (lp.double().exp() * (lp.double() - log_s)).sum(-1)
    ce = -torch.log_softmax(c, -1).gather(-1, target.clamp(min=0)[:, None]).squeeze(-1)
    rows = torch.where(target != -100, kl + hard_label_weight * ce, torch.zeros((), dtype=torch.float64))
    return rows.sum() / (target != -100).sum()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])   # 1.0: the hard label folded into the K-class pass
def test_topk_distillation_loss(backend, temperature):
    hs, ws, _, _, _, ids, lp, target = _inputs(seed=2)
    zs = (hs @ ws.T).requires_grad_(True)
    loss = fusedce.topk_distillation_loss(zs, ids, lp, target, temperature=temperature, hard_label_weight=0.3,
                                          student_softcap=4.0, logit_scale=A_S, backend=backend)
    loss.backward()
    z64 = zs.detach().double().requires_grad_(True)
    ref = _topk64(z64 * A_S, ids, lp, target, temperature, 0.3, 4.0)
    ref.backward()
    _close(loss, ref, [(zs.grad, z64.grad)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["chunked", "tiled"])
def test_linear_topk_distillation_loss(backend, method):
    hs, ws, bs, _, _, ids, lp, target = _inputs(seed=3)
    h, w, b = (t.clone().requires_grad_(True) for t in (hs, ws, bs))
    loss = fusedce.linear_topk_distillation_loss(h, w, ids, lp, target, student_bias=b, temperature=2.0,
                                                 hard_label_weight=0.3, student_softcap=4.0, logit_scale=A_S,
                                                 method=method, backend=backend)
    loss.backward()
    h64, w64, b64 = (t.double().requires_grad_(True) for t in (hs, ws, bs))
    ref = _topk64((h64 @ w64.T + b64) * A_S, ids, lp, target, 2.0, 0.3, 4.0)
    ref.backward()
    _close(loss, ref, [(h.grad, h64.grad), (w.grad, w64.grad), (b.grad, b64.grad)])


def test_errors():
    hs, ws, _, ht, wt, ids, lp, target = _inputs()
    zs, zt = hs @ ws.T, ht @ wt.T
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="logit_scale"):
            fusedce.distillation_loss(zs, zt, target, logit_scale=bad)
        with pytest.raises(ValueError, match="teacher_logit_scale"):
            fusedce.distillation_loss(zs, zt, target, teacher_logit_scale=bad)
        with pytest.raises(ValueError, match="teacher_logit_scale"):
            fusedce.linear_distillation_loss(hs, ws, ht, wt, target, teacher_logit_scale=bad)
        with pytest.raises(ValueError, match="logit_scale"):
            fusedce.topk_distillation_loss(zs, ids, lp, target, logit_scale=bad)
        with pytest.raises(ValueError, match="logit_scale"):
            fusedce.linear_topk_distillation_loss(hs, ws, ids, lp, target, logit_scale=bad)
    with pytest.raises(TypeError, match="teacher_logit_scale"):
        fusedce.distillation_loss(zs, zt, target, teacher_logit_scale="big")
