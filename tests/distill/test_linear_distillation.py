"""``fusedce.linear_distillation_loss`` (both LM heads fused with the loss), chunked and tiled, against
float64 autograd of the oracle (reference64_distill.py) on the contract's logits (since 2026-12-02: fp32
logits of the inputs' exact values, so the reference takes the exact float64 products; the chunked
backward rounds the logits' gradient to the dtype once, as stock's): every beta / reduction, hard labels, ignored rows,
softcaps, biases, dtypes, the student's three
gradients, the teacher's none, upstream scaling, poisoned allocations, empty / all-ignored batches, bad
inputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusedce
from tolerances import assert_loss, row_scale
from inputs import poisoned_allocations
from reference64_distill import distill_rows64, distillation_loss64
from tolerances import FP32_UNITS, TOLERANCES, U32, _check

BACKENDS = ("torch", "triton")   # "triton" under the interpreter (conftest.py)
METHODS = ("chunked", "tiled")
BETAS = (0.0, 0.5, 1.0, 0.1)
LEAD, H, HT, V = (3, 11), 24, 40, 96
CHUNK = 7


def _model(h_size, dtype, bias=True, lead=LEAD, n_classes=V, scale=1.0):
    hidden = (torch.randn(*lead, h_size) * scale).to(dtype)
    weight = (torch.randn(n_classes, h_size) / h_size ** 0.5 * 2.0).to(dtype)
    b = (torch.randn(n_classes) * 0.5).to(dtype) if bias else None
    return hidden, weight, b


def _inputs(dtype=torch.float32, bias=True, lead=LEAD, teacher_dtype=None, ignore_every=5):
    student = _model(H, dtype, bias, lead)
    teacher = _model(HT, teacher_dtype or dtype, bias, lead, scale=1.5)
    target = torch.randint(0, V, lead)
    if ignore_every:
        target.view(-1)[1::ignore_every] = -100
    return student, teacher, target


def _run(student, teacher, target, reduction, upstream, backend, method, **kw):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in student]
    hs, ws, bs = leaves
    ht, wt, bt = teacher
    if method == "chunked" and "chunk_size" not in kw:
        kw["chunk_size"] = CHUNK
    loss = fusedce.linear_distillation_loss(hs, ws, ht, wt, target, student_bias=bs, teacher_bias=bt,
                                            reduction=reduction, backend=backend, method=method, **kw)
    loss.backward(upstream.float() if reduction == "none" else upstream)
    return loss, [None if t is None else t.grad for t in leaves]


def _reference(student, teacher, target, reduction, upstream, **kw):
    """float64 autograd on the exact logits of both models (the fused op forms them in fp32 from the
    same values, never rounded to the inputs' dtype)."""
    leaves = [None if t is None else t.double().requires_grad_() for t in student]
    h64, w64, b64 = leaves
    z = h64 @ w64.T + (0.0 if b64 is None else b64)
    z.retain_grad()
    zt = F.linear(*[None if t is None else t.double() for t in teacher])
    ref = distillation_loss64(z, zt, target, reduction=reduction, **kw)
    ref.backward(upstream.double() if reduction == "none" else torch.tensor(float(upstream), dtype=torch.float64))
    return ref.detach(), z.grad, [None if t is None else t.grad for t in leaves], z.detach(), zt


def _factor(target, lead, reduction, upstream, num_items=None):
    kept = (target != -100).double() if target is not None else torch.ones(lead, dtype=torch.float64)
    if reduction == "none":
        return upstream.double() * kept
    g = float(upstream)
    if reduction == "sum":
        return kept * g
    d = float(num_items) if num_items is not None else float(kept.sum())
    return kept * (g / d if d else 0.0)


def _check_all(student, teacher, target, reduction, backend, method, upstream=None, num_items=None, **kw):
    dtype = student[0].dtype
    lead = student[0].shape[:-1]
    if upstream is None:
        upstream = torch.randn(lead) if reduction == "none" else torch.tensor(0.75)
    loss, grads = _run(student, teacher, target, reduction, upstream, backend, method, num_items_in_batch=num_items,
                       **kw)
    kw.pop("chunk_size", None), kw.pop("deterministic", None)
    ref, dz, ref_grads, z, zt = _reference(student, teacher, target, reduction, upstream, num_items_in_batch=num_items,
                                           **kw)
    opts = {k: kw[k] for k in ("temperature", "hard_label_weight", "student_softcap", "teacher_softcap") if k in kw}
    t_inv, hw = 1.0 / kw.get("temperature", 1.0), abs(kw.get("hard_label_weight", 0.0))
    # the logits' own fp32 rounding (summation order of the matmuls): a few u of |h| @ |W|.T per logit
    l_err = (student[0].double().abs() @ student[1].double().abs().T).amax(-1)
    l_err = l_err + (teacher[0].double().abs() @ teacher[1].double().abs().T).amax(-1)
    kept = (target != -100) if target is not None else torch.ones(lead, dtype=torch.bool)
    scale = torch.where(kept, row_scale(z, zt, **opts) + 2 * (t_inv + hw) * l_err, 0.0)
    d = float(num_items) if num_items is not None else float(kept.sum())
    assert_loss(loss, ref, scale, reduction, d)
    factor = _factor(target, lead, reduction, upstream, num_items)
    tol = TOLERANCES[dtype]
    e_dz = (FP32_UNITS * U32 * (t_inv + hw) * scale * factor.abs()).reshape(-1, 1)
    e_dz = e_dz + tol.grad_rtol * dz.abs().reshape(-1, V) + tol.grad_atol   # rounded to the dtype once
    a_dz = dz.abs().reshape(-1, V)
    h, w = student[0].double().abs().reshape(-1, H), student[1].double().abs()
    mm = FP32_UNITS * U32   # the fp32 sums of the three gradient matmuls
    bounds = [(e_dz @ w + mm * (a_dz @ w)).reshape(*lead, H), e_dz.T @ h + mm * (a_dz.T @ h),
              e_dz.sum(0) + mm * a_dz.sum(0)]
    for name, g, r, b, t in zip(("hidden", "weight", "bias"), grads, ref_grads, bounds, student):
        if t is None:
            assert g is None
            continue
        assert g.dtype == t.dtype and g.shape == t.shape, name
        _check(name, g, r, b + tol.grad_rtol * r.abs())
    hs_grad = grads[0].reshape(-1, H)
    assert bool((hs_grad[~kept.reshape(-1)] == 0).all()), "ignored rows: exactly zero hidden gradient"
    return loss, grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("method", METHODS)
def test_matches_reference(backend, method, beta, reduction):
    student, teacher, target = _inputs()
    _check_all(student, teacher, target, reduction, backend, method, beta=beta, temperature=2.0,
               hard_label_weight=0.4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_temperature_one_softcaps_no_bias(backend, method):
    student, teacher, target = _inputs(bias=False)
    for beta in (0.0, 0.5, 1.0):
        _check_all(student, teacher, target, "mean", backend, method, beta=beta, hard_label_weight=1.0,
                   student_softcap=3.0, teacher_softcap=5.0)
    _check_all(student, teacher, None, "sum", backend, method, beta=0.1, temperature=2.0, student_softcap=4.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("method", METHODS)
def test_low_precision(backend, method, dtype):
    student, teacher, target = _inputs(dtype)
    _check_all(student, teacher, target, "mean", backend, method, beta=0.5, temperature=2.0, hard_label_weight=0.3)
    _check_all(student, teacher, target, "none", backend, method, beta=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_teacher_dtype_and_auto_method(backend, method):
    student, teacher, target = _inputs(teacher_dtype=torch.bfloat16)
    _check_all(student, teacher, target, "mean", backend, method, beta=0.5, num_items=50)
    _check_all(student, teacher, target, "mean", backend, "auto", beta=1.0, hard_label_weight=0.2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_teacher_gets_no_gradient_and_inputs_unchanged(backend, method):
    student, teacher, target = _inputs()
    t_leaves = [t.clone().requires_grad_() for t in teacher]
    s_leaves = [t.clone().requires_grad_() for t in student]
    loss = fusedce.linear_distillation_loss(s_leaves[0], s_leaves[1], t_leaves[0], t_leaves[1], target,
                                            student_bias=s_leaves[2], teacher_bias=t_leaves[2], beta=0.5,
                                            method=method, backend=backend)
    loss.backward()
    assert all(t.grad is None for t in t_leaves) and all(t.grad is not None for t in s_leaves)
    assert all(torch.equal(a, b) for a, b in zip(t_leaves + s_leaves, list(teacher) + list(student)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_frozen_student_weight(backend, method):
    student, teacher, target = _inputs()
    hs = student[0].clone().requires_grad_()
    loss = fusedce.linear_distillation_loss(hs, student[1], teacher[0], teacher[1], target, beta=0.1, method=method,
                                            student_bias=student[2], teacher_bias=teacher[2], backend=backend)
    loss.backward()
    _, _, ref_grads, _, _ = _reference(student, teacher, target, "mean", torch.tensor(1.0), beta=0.1)
    assert torch.allclose(hs.grad.double(), ref_grads[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_poisoned_allocations(backend, method, reduction):
    student, teacher, target = _inputs()
    with poisoned_allocations():
        loss, grads = _check_all(student, teacher, target, reduction, backend, method, beta=0.1, temperature=2.0,
                                 hard_label_weight=0.5)
    assert not any(torch.isnan(g).any() for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_and_all_ignored(backend, method, reduction):
    for lead, fill in (((0,), 0), (LEAD, -100)):
        student, teacher, _ = _inputs(lead=lead)
        target = torch.full(lead, fill)
        leaves = [t.clone().requires_grad_() for t in student]
        loss = fusedce.linear_distillation_loss(leaves[0], leaves[1], *teacher[:2], target, student_bias=leaves[2],
                                                teacher_bias=teacher[2], reduction=reduction, beta=0.5,
                                                hard_label_weight=0.5, method=method, backend=backend)
        assert loss.dtype == torch.float32 and loss.shape == (lead if reduction == "none" else ())
        assert bool((loss == 0).all())
        loss.sum().backward()
        assert all(t.grad is not None and bool((t.grad == 0).all()) for t in leaves)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_backward_twice_and_deterministic(backend, method):
    student, teacher, target = _inputs()
    leaves = [t.clone().requires_grad_() for t in student]

    def loss_fn():
        return fusedce.linear_distillation_loss(leaves[0], leaves[1], *teacher[:2], target, student_bias=leaves[2],
                                                teacher_bias=teacher[2], beta=0.5, method=method, backend=backend,
                                                deterministic=True)

    loss = loss_fn()
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    loss.backward()   # a second backward through the retained graph: recomputed
    for a, b in zip(first, leaves):
        assert torch.allclose(a, b.grad, rtol=1e-5, atol=1e-7)
    again = torch.autograd.grad(loss_fn(), leaves)
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "deterministic=True: bitwise identical"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_upstream_scale_as_accurate_as_stock(backend, method, dtype):
    """GradScaler's S = 2^16 with a large mean denominator (gradient accumulation): each student gradient's
    relative error no worse than 2x stock's (F.linear in the dtype, then the oracle's formula on those
    logits, backward with S: the logits' gradient rounded to the dtype once S is applied), as
    tests/ce/gradients/test_loss_scaling.py asks of the CE paths."""
    student, teacher, target = _inputs(dtype)
    s, d = 2.0 ** 16, 2 ** 16
    kw = dict(beta=0.5, temperature=2.0, hard_label_weight=0.5)
    _, fused = _run(student, teacher, target, "mean", torch.tensor(s), backend, method, num_items_in_batch=d, **kw)
    leaves = [t.clone().requires_grad_() for t in student]
    rows = distill_rows64(F.linear(*leaves).float(), F.linear(*teacher).float(), target, **kw)
    (rows.float().sum() / d).backward(torch.tensor(s))
    _, _, ref, _, _ = _reference(student, teacher, target, "mean", torch.tensor(s), num_items_in_batch=d, **kw)
    for name, f, st, r in zip(("hidden", "weight", "bias"), fused, [t.grad for t in leaves], ref):
        fused_err = float((f.double() - r).norm() / r.norm())
        stock_err = float((st.double() - r).norm() / r.norm())
        assert torch.isfinite(f).all(), name
        assert fused_err <= 2.0 * stock_err + 2.0 ** -20, f"{name}: fused {fused_err:.3e} vs stock {stock_err:.3e}"


BAD = [
    (dict(teacher_weight=lambda a: a["teacher_weight"][:-1], teacher_bias=lambda a: None), ValueError,
     "vocabulary size"),
    (dict(teacher_hidden=lambda a: a["teacher_hidden"][:, :-1]), ValueError, "same tokens"),
    (dict(student_weight=lambda a: a["student_weight"][:, :-1]), ValueError, "student_hidden.shape"),
    (dict(teacher_weight=lambda a: a["teacher_weight"][:, :-1]), ValueError, "teacher_hidden.shape"),
    (dict(student_bias=lambda a: a["student_bias"][:-1]), ValueError, "student_bias"),
    (dict(student_weight=lambda a: a["student_weight"].double()), TypeError, "float32"),
    (dict(student_weight=lambda a: a["student_weight"].half()), TypeError, "share a dtype"),
    (dict(teacher_bias=lambda a: a["teacher_bias"].half()), TypeError, "share a dtype"),
    (dict(beta=lambda a: 2.0), ValueError, "beta"),
    (dict(temperature=lambda a: 0.0), ValueError, "temperature"),
    (dict(target=lambda a: None, hard_label_weight=lambda a: 1.0), ValueError, "hard_label_weight"),
    (dict(target=lambda a: a["target"].float()), TypeError, "int64 or int32"),
    (dict(target=lambda a: a["target"][:, 1:]), ValueError, "target shape"),
    (dict(target=lambda a: a["target"].clone().fill_(V)), IndexError, "out of range"),
    (dict(method=lambda a: "fused"), ValueError, "method"),
    (dict(method=lambda a: "tiled", chunk_size=lambda a: 8), ValueError, "chunk_size"),
    (dict(chunk_size=lambda a: 0), ValueError, "chunk_size"),
    (dict(deterministic=lambda a: 1), TypeError, "deterministic"),
    (dict(backend=lambda a: "cute"), RuntimeError, "cute"),
    (dict(teacher_hidden=lambda a: a["teacher_hidden"].to("meta"), teacher_weight=lambda a: a["teacher_weight"].to(
        "meta"), teacher_bias=lambda a: None), ValueError, "meta"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_inputs(case):
    (hs, ws, bs), (ht, wt, bt), target = _inputs()
    args = dict(student_hidden=hs, student_weight=ws, teacher_hidden=ht, teacher_weight=wt, target=target,
                student_bias=bs, teacher_bias=bt)
    changes, exc, match = BAD[case]
    args.update({k: f(args) for k, f in changes.items()})
    positional = [args.pop(k) for k in ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight",
                                        "target")]
    with pytest.raises(exc, match=match):
        fusedce.linear_distillation_loss(*positional, **args)
