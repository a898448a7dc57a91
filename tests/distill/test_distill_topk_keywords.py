"""The top-k teacher has one door (issue 26): ``topk_distillation_loss`` / ``linear_topk_distillation_loss``,
checked here against the float64 formula ``sum_k p_k (log p_k - log softmax(z_s / T)[id_k])`` (plus the
hard-label CE); ``teacher_ids=`` / ``teacher_log_probs=`` on the dense distillation losses (their former
top-k form) are a ``TypeError`` naming the top-k function, and a dense call without its teacher is
Python's ``TypeError`` for a missing argument."""
import pytest
import torch

import fusedce

BACKENDS = ["torch", "triton"]


def _reference(zs, ids, lp, target, temperature, hard_label_weight, ignore_index=-100):
    zs64 = zs.double()
    log_s = torch.log_softmax(zs64 / temperature, dim=-1).gather(-1, ids)
    p = lp.double().exp()
    kl = (p * (lp.double() - log_s)).sum(-1)
    ce = -torch.log_softmax(zs64, dim=-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    rows = torch.where(target != ignore_index, kl + hard_label_weight * ce, torch.zeros((), dtype=torch.float64))
    return rows.sum() / (target != ignore_index).sum()


def _inputs(n=12, h=16, v=70, k=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / 4
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    lp = torch.log_softmax(torch.randn(n, v, generator=g), -1).gather(-1, ids)
    target = torch.randint(0, v, (n,), generator=g)
    target[::4] = -100
    return hidden, weight, ids, lp, target


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature,hard", [(1.0, 0.0), (2.0, 0.5)])
def test_logits_form(backend, temperature, hard):
    hidden, weight, ids, lp, target = _inputs()
    zs = (hidden @ weight.T).requires_grad_(True)
    loss = fusedce.topk_distillation_loss(zs, ids, lp, target, temperature=temperature, hard_label_weight=hard,
                                          backend=backend)
    loss.backward()
    z64 = zs.detach().double().requires_grad_(True)
    ref = _reference(z64, ids, lp, target, temperature, hard)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-5 * (1 + abs(ref.item()))
    torch.testing.assert_close(zs.grad.double(), z64.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["chunked", "tiled"])
def test_linear_form(backend, method):
    hidden, weight, ids, lp, target = _inputs(seed=1)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = fusedce.linear_topk_distillation_loss(h, w, ids, lp, target, temperature=2.0, hard_label_weight=0.25,
                                                 method=method, backend=backend)
    loss.backward()
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref = _reference(h64 @ w64.T, ids, lp, target, 2.0, 0.25)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-5 * (1 + abs(ref.item()))
    torch.testing.assert_close(h.grad.double(), h64.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w.grad.double(), w64.grad, atol=1e-5, rtol=1e-4)


def test_errors():
    hidden, weight, ids, lp, target = _inputs()
    zs = hidden @ weight.T
    for kw in (dict(teacher_ids=ids, teacher_log_probs=lp), dict(teacher_ids=ids), dict(teacher_log_probs=lp)):
        with pytest.raises(TypeError, match=r"goes to fusedce\.topk_distillation_loss"):
            fusedce.distillation_loss(zs, target=target, **kw)
        with pytest.raises(TypeError, match=r"goes to fusedce\.topk_distillation_loss"):
            fusedce.distillation_loss(zs, zs, target, **kw)
        with pytest.raises(TypeError, match=r"goes to fusedce\.linear_topk_distillation_loss"):
            fusedce.linear_distillation_loss(hidden, weight, target=target, **kw)
        with pytest.raises(TypeError, match=r"goes to fusedce\.linear_topk_distillation_loss"):
            fusedce.linear_distillation_loss(hidden, weight, hidden, weight, target, **kw)
    with pytest.raises(TypeError, match="teacher_logits"):
        fusedce.distillation_loss(zs, target=target)
    with pytest.raises(TypeError, match="teacher_weight"):
        fusedce.linear_distillation_loss(hidden, weight, hidden, target=target)
