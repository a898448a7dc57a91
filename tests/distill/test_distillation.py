"""``fusedce.distillation_loss`` (logits given) against the float64 oracle (reference64_distill.py): every
beta / temperature / reduction, hard labels, ignored rows, softcaps, dtypes, upstream gradients, poisoned
allocations, empty and all-ignored batches, masked (-inf) teacher classes, bad inputs."""
from __future__ import annotations

import math

import pytest
import torch

import fusedce
from tolerances import assert_grad, assert_loss, row_scale
from inputs import poisoned_allocations
from reference64_distill import distillation_loss64

BACKENDS = ("torch", "triton")   # "triton" under the interpreter (conftest.py)
BETAS = (0.0, 0.5, 1.0, 0.1)
LEAD, V = (3, 17), 96


def _inputs(dtype=torch.float32, lead=LEAD, n_classes=V, ignore_every=4):
    zs = (torch.randn(*lead, n_classes) * 2.0).to(dtype)
    zt = (torch.randn(*lead, n_classes) * 3.0).to(dtype)
    target = torch.randint(0, n_classes, lead)
    if ignore_every:
        target.view(-1)[::ignore_every] = -100
    return zs, zt, target


def _run(zs, zt, target, reduction, upstream, backend, **kw):
    student = zs.clone().requires_grad_()
    loss = fusedce.distillation_loss(student, zt, target, reduction=reduction, backend=backend, **kw)
    loss.backward(upstream.float() if reduction == "none" else upstream)
    return loss, student.grad


def _reference(zs, zt, target, reduction, upstream, **kw):
    z64 = zs.double().requires_grad_()
    ref = distillation_loss64(z64, zt, target, reduction=reduction, **kw)
    ref.backward(upstream.double() if reduction == "none" else torch.tensor(float(upstream), dtype=torch.float64))
    return ref.detach(), z64.grad


def _factor(target, lead, reduction, upstream, num_items=None):
    """Each row's upstream gradient of its loss (0 on ignored rows)."""
    kept = (target != -100).double() if target is not None else torch.ones(lead, dtype=torch.float64)
    if reduction == "none":
        return upstream.double() * kept
    g = float(upstream)
    if reduction == "sum":
        return kept * g
    d = float(num_items) if num_items is not None else float(kept.sum())
    return kept * (g / d if d else 0.0)


def _check_all(zs, zt, target, reduction, backend, dtype=torch.float32, upstream=None, num_items=None, **kw):
    lead = zs.shape[:-1]
    if upstream is None:
        upstream = torch.randn(lead) if reduction == "none" else torch.tensor(1.7)
    loss, grad = _run(zs, zt, target, reduction, upstream, backend, num_items_in_batch=num_items, **kw)
    ref, ref_grad = _reference(zs, zt, target, reduction, upstream, num_items_in_batch=num_items, **kw)
    opts = {k: kw[k] for k in ("temperature", "hard_label_weight", "student_softcap", "teacher_softcap") if k in kw}
    scale = row_scale(zs, zt, **opts)
    kept = (target != -100) if target is not None else torch.ones(lead, dtype=torch.bool)
    scale = torch.where(kept, scale, 0.0)
    d = float(num_items) if num_items is not None else float(kept.sum())
    assert_loss(loss, ref, scale, reduction, d)
    assert grad.dtype == zs.dtype and grad.shape == zs.shape
    assert_grad("logits", grad, ref_grad, scale, _factor(target, lead, reduction, upstream, num_items), dtype,
                kw.get("temperature", 1.0), kw.get("hard_label_weight", 0.0))
    assert bool((grad[~kept] == 0).all()), "ignored rows must get exactly zero gradient"
    return loss, grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", BETAS)
def test_matches_reference(backend, beta, temperature, reduction):
    zs, zt, target = _inputs()
    _check_all(zs, zt, target, reduction, backend, beta=beta, temperature=temperature)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", BETAS)
def test_hard_labels_and_softcaps(backend, beta):
    zs, zt, target = _inputs()
    for caps in ((None, 4.0), (6.0, None), (5.0, 9.0)):
        for temperature in (1.0, 2.0):
            _check_all(zs, zt, target, "mean", backend, beta=beta, temperature=temperature, hard_label_weight=0.7,
                       student_softcap=caps[0], teacher_softcap=caps[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_low_precision(backend, dtype, reduction):
    zs, zt, target = _inputs(dtype)
    _check_all(zs, zt, target, reduction, backend, dtype, beta=0.5, temperature=2.0, hard_label_weight=0.3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_and_no_target(backend):
    zs, zt, _ = _inputs()
    _check_all(zs, zt.to(torch.bfloat16).float(), None, "mean", backend, beta=0.1)
    loss = fusedce.distillation_loss(zs, zt.to(torch.bfloat16), backend=backend, beta=0.1)
    ref = distillation_loss64(zs.double(), zt.to(torch.bfloat16).double(), beta=0.1)
    assert abs(float(loss) - float(ref)) <= 1e-5 * (1 + abs(float(ref)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_num_items_in_batch_and_3d_shapes(backend):
    zs, zt, target = _inputs(lead=(2, 5, 7))
    _check_all(zs, zt, target, "mean", backend, num_items=123, beta=0.5)
    _check_all(zs, zt, target, "mean", backend, num_items=torch.tensor(9.0), beta=0.0, hard_label_weight=1.0)
    out = fusedce.distillation_loss(zs, zt, target, reduction="none", backend=backend)
    assert out.shape == (2, 5, 7) and out.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_rows_and_int32_target(backend):
    zs, zt, _ = _inputs(lead=(6, 4), n_classes=2 * V)
    zs, zt = zs[::2, :, ::2], zt.transpose(0, 1)[:, ::2, ::2].transpose(0, 1)
    target = torch.randint(0, V, (6, 4))
    target[1] = -100
    _check_all(zs, zt, target[::2], "sum", backend, beta=0.5, hard_label_weight=0.5)
    _check_all(zs, zt, target[::2].int(), "mean", backend, beta=1.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_gets_no_gradient(backend):
    zs, zt, target = _inputs()
    student, teacher = zs.clone().requires_grad_(), zt.clone().requires_grad_()
    fusedce.distillation_loss(student, teacher, target, beta=0.5, backend=backend).backward()
    assert teacher.grad is None and student.grad is not None
    assert torch.equal(teacher, zt) and torch.equal(student.detach(), zs), "inputs must never be modified"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_poisoned_allocations(backend, reduction):
    zs, zt, target = _inputs()
    with poisoned_allocations():
        loss, grad = _check_all(zs, zt, target, reduction, backend, beta=0.1, temperature=2.0, hard_label_weight=0.5)
    assert not torch.isnan(loss).any() and not torch.isnan(grad).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(backend, reduction):
    student = torch.randn(0, V, requires_grad=True)
    loss = fusedce.distillation_loss(student, torch.randn(0, V), torch.zeros(0, dtype=torch.long),
                                     reduction=reduction, beta=0.5, backend=backend)
    assert loss.dtype == torch.float32
    assert loss.shape == ((0,) if reduction == "none" else ())
    loss.sum().backward()
    assert student.grad.shape == (0, V)
    if reduction != "none":
        assert float(loss.detach()) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_all_ignored(backend, reduction, beta):
    zs, zt, _ = _inputs()
    target = torch.full(LEAD, -100)
    zs[0, 0, 0] = float("nan")   # an ignored row's NaN must not leak into the loss or other rows
    student = zs.clone().requires_grad_()
    loss = fusedce.distillation_loss(student, zt, target, reduction=reduction, beta=beta, hard_label_weight=0.5,
                                     backend=backend)
    loss.sum().backward()
    assert bool((loss == 0).all()) and bool((student.grad == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", BETAS)
def test_masked_teacher_vocabulary(backend, beta):
    """-inf teacher logits (a masked vocabulary): t = 0 there, 0 log 0 = 0; with beta = 1 the reverse KL is
    infinite (the student puts mass where the teacher has none), as the formula and the oracle say."""
    zs, zt, target = _inputs()
    zt[..., V // 2:] = float("-inf")
    if beta == 1.0:
        loss = fusedce.distillation_loss(zs, zt, target, beta=beta, backend=backend)
        assert math.isinf(float(loss)) and float(loss) > 0
        assert math.isinf(float(distillation_loss64(zs, zt, target, beta=beta)))
        return
    _check_all(zs, zt, target, "mean", backend, beta=beta, hard_label_weight=0.5)
    zt_all = torch.full_like(zt, float("-inf"))
    zt_all[..., 3] = 0.0   # a one-hot teacher
    _check_all(zs, zt_all, target, "none", backend, beta=beta, temperature=2.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_twice(backend):
    zs, zt, target = _inputs()
    student = zs.clone().requires_grad_()
    loss = fusedce.distillation_loss(student, zt, target, beta=0.5, backend=backend)
    (g1,) = torch.autograd.grad(loss, student, retain_graph=True)
    loss.backward()
    assert torch.equal(g1, student.grad)
    with pytest.raises(RuntimeError, match="double backward"):
        loss2 = fusedce.distillation_loss(student, zt, target, beta=0.5, backend=backend)
        (g,) = torch.autograd.grad(loss2, student, create_graph=True)
        g.sum().backward()


def test_no_grad_and_frozen_student():
    zs, zt, target = _inputs()
    with torch.no_grad():
        a = fusedce.distillation_loss(zs.clone().requires_grad_(), zt, target, beta=0.5)
    b = fusedce.distillation_loss(zs, zt, target, beta=0.5)
    assert torch.equal(a, b) and not a.requires_grad


BAD = [
    (lambda zs, zt, t: dict(teacher_logits=zt[..., :-1]), ValueError, "vocabulary size"),
    (lambda zs, zt, t: dict(teacher_logits=zt[:, :-1]), ValueError, "same tokens"),
    (lambda zs, zt, t: dict(beta=1.5), ValueError, "beta"),
    (lambda zs, zt, t: dict(beta=-0.1), ValueError, "beta"),
    (lambda zs, zt, t: dict(temperature=0.0), ValueError, "temperature"),
    (lambda zs, zt, t: dict(temperature=-1.0), ValueError, "temperature"),
    (lambda zs, zt, t: dict(temperature=float("inf")), ValueError, "temperature"),
    (lambda zs, zt, t: dict(temperature=float("nan")), ValueError, "temperature"),
    (lambda zs, zt, t: dict(target=None, hard_label_weight=0.5), ValueError, "hard_label_weight"),
    (lambda zs, zt, t: dict(target=t.float()), TypeError, "int64 or int32"),
    (lambda zs, zt, t: dict(target=t[:, :-1]), ValueError, "target shape"),
    (lambda zs, zt, t: dict(target=t.clone().fill_(V)), IndexError, "out of range"),
    (lambda zs, zt, t: dict(target=t.clone().fill_(-1)), IndexError, "out of range"),
    (lambda zs, zt, t: dict(student_logits=zs.long()), TypeError, "float32"),
    (lambda zs, zt, t: dict(teacher_logits=zt.double()), TypeError, "float32"),
    (lambda zs, zt, t: dict(reduction="batchmean"), ValueError, "reduction"),
    (lambda zs, zt, t: dict(student_softcap=0.0), ValueError, "student_softcap"),
    (lambda zs, zt, t: dict(teacher_softcap=-1.0), ValueError, "teacher_softcap"),
    (lambda zs, zt, t: dict(num_items_in_batch=-1), ValueError, "num_items_in_batch"),
    (lambda zs, zt, t: dict(backend="cute"), RuntimeError, "cute"),
    (lambda zs, zt, t: dict(backend="nope"), ValueError, "unknown backend"),
    (lambda zs, zt, t: dict(teacher_logits=zt.to("meta")), ValueError, "meta"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_inputs(case):
    zs, zt, target = _inputs()
    make, exc, match = BAD[case]
    args = dict(student_logits=zs, teacher_logits=zt, target=target)
    args.update(make(zs, zt, target))
    with pytest.raises(exc, match=match):
        fusedce.distillation_loss(args.pop("student_logits"), args.pop("teacher_logits"), args.pop("target"), **args)


def test_torch_compile_smoke():
    """Under torch.compile (no target-range sync, no compaction): the eager values and gradient."""
    zs, zt, target = _inputs(lead=(8,), n_classes=32)
    a, b = zs.clone().requires_grad_(), zs.clone().requires_grad_()
    kw = dict(beta=0.5, temperature=2.0, hard_label_weight=0.5, backend="torch")
    compiled = torch.compile(lambda s, t, y: fusedce.distillation_loss(s, t, y, **kw))
    loss_c = compiled(a, zt, target)
    loss_c.backward()
    loss_e = fusedce.distillation_loss(b, zt, target, **kw)
    loss_e.backward()
    assert torch.allclose(loss_c.detach(), loss_e.detach(), rtol=1e-6) and torch.allclose(a.grad, b.grad, atol=1e-7)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_teacher_logit_is_never_a_silent_zero(backend, bad):
    """A NaN (or +inf) teacher logit makes that row's teacher distribution NaN: the row's loss must be NaN
    (as the float64 formula and TRL give), never 0.0 with a NaN gradient (found by a fresh user)."""
    g = torch.Generator().manual_seed(7)
    student, teacher = torch.randn(5, 9, generator=g), torch.randn(5, 9, generator=g)
    teacher[1, 4] = bad
    rows = fusedce.distillation_loss(student, teacher, backend=backend, reduction="none")
    assert torch.isnan(rows[1]), rows
    assert torch.isfinite(rows[[0, 2, 3, 4]]).all(), rows


def test_negative_hard_label_weight_and_swapped_heads_are_named():
    """A negative ``hard_label_weight`` (the loss went to -6 on a fresh user's input) is a ValueError on the
    four losses; swapped student hidden states and head get a hint naming them."""
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    ids, lp = torch.randint(0, 10, (4, 3)), torch.full((4, 3), -2.0)
    for call in (lambda: fusedce.linear_distillation_loss(h, w, h, w, t, hard_label_weight=-1.0),
                 lambda: fusedce.distillation_loss(torch.randn(4, 10), torch.randn(4, 10), t, hard_label_weight=-0.5),
                 lambda: fusedce.topk_distillation_loss(torch.randn(4, 10), ids, lp, t, hard_label_weight=-1.0),
                 lambda: fusedce.linear_topk_distillation_loss(h, w, ids, lp, t, hard_label_weight=-1.0)):
        with pytest.raises(ValueError, match="hard_label_weight must be >= 0"):
            call()
    with pytest.raises(ValueError, match="student_hidden .* and student_weight look swapped"):
        fusedce.linear_distillation_loss(w, h, h, w, t)
