"""The contract's top-k teacher form of the distillation losses: ``teacher_ids=`` / ``teacher_log_probs=``
in place of the teacher's logits (or hidden states and head), checked against the float64 formula
``sum_k p_k (log p_k - log softmax(z_s / T)[id_k])`` (plus the hard-label CE), and the errors of a teacher
given twice, half or not at all."""
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
    loss = fusedce.distillation_loss(zs, target=target, teacher_ids=ids, teacher_log_probs=lp,
                                     temperature=temperature, hard_label_weight=hard, backend=backend)
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
    loss = fusedce.linear_distillation_loss(h, w, target=target, teacher_ids=ids, teacher_log_probs=lp,
                                            temperature=2.0, hard_label_weight=0.25, method=method,
                                            backend=backend)
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
    with pytest.raises(TypeError, match="teacher is missing"):
        fusedce.distillation_loss(zs, target=target)
    with pytest.raises(ValueError, match="go together"):
        fusedce.distillation_loss(zs, target=target, teacher_ids=ids)
    with pytest.raises(ValueError, match="give the teacher once"):
        fusedce.distillation_loss(zs, zs, target, teacher_ids=ids, teacher_log_probs=lp)
    with pytest.raises(ValueError, match="beta must be 0"):
        fusedce.distillation_loss(zs, target=target, teacher_ids=ids, teacher_log_probs=lp, beta=0.5)
    with pytest.raises(ValueError, match="teacher_softcap"):
        fusedce.distillation_loss(zs, target=target, teacher_ids=ids, teacher_log_probs=lp, teacher_softcap=30.0)
    with pytest.raises(ValueError, match="give the teacher once"):
        fusedce.linear_distillation_loss(hidden, weight, teacher_bias=torch.zeros(70), target=target,
                                         teacher_ids=ids, teacher_log_probs=lp)
    with pytest.raises(TypeError, match="teacher is missing"):
        fusedce.linear_distillation_loss(hidden, weight, hidden, target=target)
