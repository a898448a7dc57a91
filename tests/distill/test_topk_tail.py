"""The top-k teacher's tail (issue 30 item 3): ``topk_distillation_loss(..., tail=True)`` /
``linear_topk_distillation_loss(..., tail=True)`` add ``p_tail log(p_tail / s_tail)``, checked against the
float64 formula of ``reference64_topk`` (the (K+1)-bin KL), on both backends and both linear methods,
every reduction, with temperature, softcap, logit_scale, hard labels, ``num_items_in_batch``, duplicate
ids, ``-inf`` / ``ignore_index`` padding and ignored tokens; rows whose K classes hold all but 1e-6 of
the student's mass (where ``1 - sum_k s_k`` in fp32 would keep one digit), rows with ``p_tail = 0``
exactly, K classes covering the vocabulary; ``return_stats``; the teacher's value checks.

Shapes: V = 300 (a partial last Triton block; with the tiny tiles of ``test_topk_distillation`` the tail
pass merges 5 vocabulary blocks of 64 and row blocks of 4; with ``small_wide_blocks`` the whole-row blocks
hold 2 rows), K = 6, leading (3, 5) / (2, 7) tokens."""
import pytest
import torch

import fusedce
from fusedce.distill import tail as student_tail
from fusedce.core.options import log_prob_options
from inputs import poisoned_allocations
from reference64_linear import make_linear
from reference64_topk import log_tail64, reduce64, student_log_softmax64, topk_rows64
from tolerances import FP32_MATH_ATOL, GRAD_RTOL
from topk_cases import HIDDEN, K, V, check, make_hard_target, tiny_tiles  # noqa: F401 (tiny_tiles: an autouse fixture)

# (temperature, hard_label_weight, student_softcap, logit_scale)
SETTINGS = {"plain": (1.0, 0.0, None, 1.0), "hard_folded": (1.0, 0.5, None, 1.0),
            "t2_hard_cap": (2.0, 0.3, 8.0, 1.0), "t0.7_scale": (0.7, 0.0, None, 0.5)}


@pytest.fixture(autouse=True)
def small_wide_blocks(monkeypatch):
    """The tail pass's whole-row blocks (logits form, chunked method) of 2 rows at V = 300, so that its
    row-block loop and the backward's per-thread vocabulary split run with several blocks here too."""
    monkeypatch.setattr(student_tail, "_WIDE_ELEMENTS", 2 * V)


def make_teacher(lead, k=K, n_classes=V, ignore_index=-100, seed=0):
    """The top-k of a random teacher distribution (ids, fp32 log-probs (..., k)), normalized over the V
    classes (so ``p_tail = 1 - sum_k p_k`` is its real tail), with: one ``-inf`` padding entry every third
    token (id 0), an ``ignore_index`` id, and a duplicated id (token 4's second entry repeats its first,
    with its own log-prob)."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.log_softmax(torch.randn(*lead, n_classes, generator=g) * 2, dim=-1)
    lp, ids = teacher.topk(k, dim=-1)
    lp, ids = lp.reshape(-1, k).clone(), ids.reshape(-1, k).clone()
    lp[::3, -1], ids[::3, -1] = float("-inf"), 0
    if lp.shape[0] > 4:
        ids[1, 0] = ignore_index
        ids[4, 1] = ids[4, 0]
        lp[4, 1] = lp[4, 2]   # a smaller mass than the first copy: the teacher's sum stays below 1
    return ids.reshape(*lead, k), lp.reshape(*lead, k)


def upstream(loss):
    return torch.randn(loss.shape) if loss.dim() else torch.tensor(1.3)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_tail_logits(backend, setting, reduction):
    temperature, hard, cap, scale = SETTINGS[setting]
    logits = (torch.randn(3, 5, V) * 3).requires_grad_()
    ids, lp = make_teacher((3, 5))
    target = make_hard_target((3, 5))
    before = (logits.detach().clone(), ids.clone(), lp.clone(), target.clone())
    with poisoned_allocations():
        loss = fusedce.topk_distillation_loss(logits, ids, lp, target, temperature=temperature, hard_label_weight=hard,
                                              reduction=reduction, student_softcap=cap, logit_scale=scale, tail=True,
                                              backend=backend)
        g = upstream(loss)
        loss.backward(g)
    x64 = logits.detach().double().requires_grad_()
    ref = reduce64(topk_rows64(x64, ids, lp, target, temperature=temperature, hard_label_weight=hard, softcap=cap,
                               logit_scale=scale, tail=True), target, reduction)
    check(loss, ref.detach(), FP32_MATH_ATOL * max(1.0, ref.detach().abs().max().item()), name="loss")
    ref.backward(g.double())
    check(logits.grad, x64.grad, 1e-6, GRAD_RTOL[torch.float32], "grad")
    assert bool((logits.grad[target == -100] == 0).all())
    assert all(torch.equal(a, b) for a, b in zip(before, (logits.detach(), ids, lp, target)))
    # the tail is really there: without it the loss differs (by much more than the tolerance)
    plain = fusedce.topk_distillation_loss(logits.detach(), ids, lp, target, temperature=temperature,
                                           hard_label_weight=hard, reduction=reduction, student_softcap=cap,
                                           logit_scale=scale, backend=backend)
    assert (plain - loss.detach()).abs().max().item() > 1e-3


@pytest.mark.parametrize("method", ["chunked", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("setting", ["hard_folded", "t2_hard_cap", "t0.7_scale"])
def test_tail_linear(backend, setting, dtype, method):
    temperature, hard, cap, scale = SETTINGS[setting]
    hidden, weight, bias = make_linear((2, 7), HIDDEN, V, dtype, bias=True, logit_scale=4.0)
    ids, lp = make_teacher((2, 7), seed=1)
    target = make_hard_target((2, 7))
    with poisoned_allocations():
        loss = fusedce.linear_topk_distillation_loss(hidden, weight, ids, lp, target, student_bias=bias,
                                                     temperature=temperature, hard_label_weight=hard,
                                                     student_softcap=cap, logit_scale=scale, tail=True, method=method,
                                                     backend=backend, chunk_size=4 if method == "chunked" else None)
        loss.backward()
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    exact = torch.nn.functional.linear(*leaves)   # fp32 logits from the operands' values: their float64 logits
    ref = reduce64(topk_rows64(exact, ids, lp, target, temperature=temperature, hard_label_weight=hard, softcap=cap,
                               logit_scale=scale, tail=True), target, "mean")
    check(loss, ref.detach(), FP32_MATH_ATOL, name="loss")
    ref.backward()
    for name, t, r in zip(("hidden", "weight", "bias"), (hidden, weight, bias), leaves):
        assert t.grad.dtype == dtype
        check(t.grad, r.grad, 1e-6, GRAD_RTOL[dtype], f"grad_{name}")
    assert bool((hidden.grad[target == -100] == 0).all())


def _near_total(n, mass_out=1e-6, seed=2):
    """Student logits (n, V) whose 6 top classes hold ``1 - mass_out`` of the softmax, and a teacher
    that keeps half its mass outside them (p_tail = 0.5): the tail term is ``0.5 log(0.5 / s_tail)``
    with ``s_tail ~ mass_out``; its gradient pulls the 294 other classes up."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(n)])
    outside = torch.ones(n, V, dtype=torch.bool).scatter_(1, ids, False)
    rest = torch.where(outside, x, float("-inf")).logsumexp(-1, keepdim=True) \
        - x.gather(1, ids).logsumexp(-1, keepdim=True)
    boost = rest + torch.log(torch.tensor((1 - mass_out) / mass_out, dtype=torch.float64))   # sum_k s_k = 1 - mass_out
    x = x.scatter(1, ids, x.gather(1, ids) + boost).float()
    lp = torch.log(torch.full((n, K), 0.5 / K))
    return x, ids, lp


@pytest.mark.parametrize("mass_out", [1e-6, 1e-9])
def test_tail_accurate_when_the_k_classes_hold_almost_everything(backend, mass_out):
    """``s_tail`` relative error of a few fp32 roundings where ``1 - sum_k s_k`` (fp32) would be off by
    ~1e-7 / mass_out (a few percent at 1e-6, everything at 1e-9): through the public loss (an error of
    r in ``s_tail`` moves the term by ``0.5 r``) and directly (``distill/tail.py``)."""
    x, ids, lp = _near_total(8, mass_out)
    logits = x.clone().requires_grad_()
    loss = fusedce.topk_distillation_loss(logits, ids, lp, tail=True, reduction="none", backend=backend)
    x64 = x.double().requires_grad_()
    ref = topk_rows64(x64, ids, lp, tail=True)
    check(loss, ref.detach(), FP32_MATH_ATOL * ref.abs().max().item(), name="loss")   # 1 - sum_k s_k: off by ~0.02
    g = torch.randn(8)
    loss.backward(g)
    ref.backward(g.double())
    check(logits.grad, x64.grad, 1e-7, GRAD_RTOL[torch.float32], "grad")
    keep = torch.ones_like(ids, dtype=torch.bool)
    opts = log_prob_options(-100, 1.0, None)
    mine = student_tail.log_tail_logits(x, ids, opts).double()
    exact = log_tail64(torch.log_softmax(x.double(), dim=-1), ids, keep)
    assert (exact.exp() / mass_out - 1).abs().max().item() < 1e-2   # the rows are what they claim
    # log s_tail (~ -14 / -21) within 3 half-ulps of its own fp32 value, i.e. s_tail to a relative ~1e-6
    # (``1 - sum_k s_k`` in fp32: off by 0.18 in the log at 1e-6, -inf at 1e-9)
    assert bool(((mine - exact).abs() <= 3 * 2.0 ** -24 * exact.abs()).all())


@pytest.mark.parametrize("method", ["chunked", "tiled"])
def test_tail_accurate_linear(backend, method):
    """The same near-total rows through the LM head: logits ``hidden @ weight.T`` with ``weight = I`` on
    the first V of H = V dimensions (the logits are then the hidden values exactly)."""
    x, ids, lp = _near_total(6, 1e-6, seed=3)
    hidden = x.clone().requires_grad_()
    weight = torch.eye(V).requires_grad_()
    loss = fusedce.linear_topk_distillation_loss(hidden, weight, ids, lp, tail=True, reduction="sum", method=method,
                                                 backend=backend)
    h64, w64 = x.double().requires_grad_(), torch.eye(V, dtype=torch.float64).requires_grad_()
    ref = topk_rows64(h64 @ w64.T, ids, lp, tail=True).sum()
    check(loss, ref.detach(), FP32_MATH_ATOL * ref.abs().item(), name="loss")
    loss.backward()
    ref.backward()
    check(hidden.grad, h64.grad, 1e-7, GRAD_RTOL[torch.float32], "grad_hidden")
    check(weight.grad, w64.grad, 1e-7, GRAD_RTOL[torch.float32], "grad_weight")


def test_zero_tail_gives_no_term_and_a_finite_gradient(backend):
    """``p_tail = 0`` exactly (token 0: one entry of log-prob 0, the rest -inf; token 1: all mass in K
    up to the float64 rounding, clamped; token 2: K covers the vocabulary): the term is 0, and the loss
    and the gradient equal those of ``tail=False``, finite."""
    n_classes = 8
    logits = (torch.randn(3, n_classes) * 2).requires_grad_()
    ids = torch.tensor([[3, 0, 0, 0, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0, 0, 0], list(range(n_classes))])
    lp = torch.full((3, n_classes), float("-inf"))
    lp[0, 0] = 0.0
    lp[1, :2] = torch.tensor([0.25, 0.75]).log()
    lp[2] = torch.log_softmax(torch.randn(n_classes), dim=-1)
    out = fusedce.topk_distillation_loss(logits, ids, lp, reduction="none", tail=True, backend=backend)
    out.sum().backward()
    grad_tail, logits.grad = logits.grad.clone(), None
    plain = fusedce.topk_distillation_loss(logits, ids, lp, reduction="none", backend=backend)
    plain.sum().backward()
    assert torch.equal(out, plain)
    assert bool(torch.isfinite(grad_tail).all()) and torch.equal(grad_tail, logits.grad)
    x64 = logits.detach().double()
    torch.testing.assert_close(out.double(), topk_rows64(x64, ids, lp, tail=True), rtol=0, atol=2e-6)


def test_k_covering_v_is_the_full_forward_kl(backend):
    """K = V (the teacher's whole distribution, sorted): the tail bin is empty on both sides, and the
    loss is the full forward KL with or without ``tail``."""
    student = torch.randn(9, V) * 2
    lp, ids = torch.log_softmax(torch.randn(9, V) * 2, dim=-1).sort(dim=-1, descending=True)
    a = fusedce.topk_distillation_loss(student, ids, lp, reduction="none", tail=True, backend=backend)
    b = fusedce.topk_distillation_loss(student, ids, lp, reduction="none", backend=backend)
    assert torch.equal(a, b)
    log_s = torch.log_softmax(student.double(), dim=-1).gather(-1, ids)
    expected = (lp.double().exp() * (lp.double() - log_s)).sum(-1)
    torch.testing.assert_close(a.double(), expected, rtol=0, atol=FP32_MATH_ATOL)


def test_num_items_and_no_target(backend):
    logits = (torch.randn(4, 3, V) * 2).requires_grad_()
    ids, lp = make_teacher((4, 3), seed=4)
    rows = topk_rows64(logits.detach().double(), ids, lp, tail=True)
    loss = fusedce.topk_distillation_loss(logits, ids, lp, num_items_in_batch=5, tail=True, backend=backend)
    check(loss, rows.sum() / 5, FP32_MATH_ATOL, name="num_items")
    hidden, weight, _ = make_linear((4, 3), HIDDEN, V)
    for method in ("chunked", "tiled"):
        loss = fusedce.linear_topk_distillation_loss(hidden, weight, ids, lp, tail=True, method=method,
                                                     backend=backend)
        exact = hidden.detach().double() @ weight.detach().double().T
        check(loss, topk_rows64(exact, ids, lp, tail=True).mean(), FP32_MATH_ATOL,
              name=f"mean without target, {method}")


@pytest.mark.parametrize("tail", [False, True])
def test_return_stats(backend, tail):
    logits = (torch.randn(3, 5, V) * 3).requires_grad_()
    ids, lp = make_teacher((3, 5), seed=5)
    target = make_hard_target((3, 5))
    out = fusedce.topk_distillation_loss(logits, ids, lp, target, temperature=1.5, tail=tail, return_stats=True,
                                         backend=backend)
    assert isinstance(out, fusedce.TopkDistillationOutput)
    loss = fusedce.topk_distillation_loss(logits, ids, lp, target, temperature=1.5, tail=tail, backend=backend)
    assert torch.equal(out.loss, loss)
    keep = (lp != float("-inf")) & (ids != -100) & (target != -100)[..., None]
    s = student_log_softmax64(logits.detach().double(), 1.5, None).exp().gather(-1, torch.where(keep, ids, 0))
    teacher = torch.where(keep, lp.double().exp(), 0.0).sum(-1)
    student = torch.where(keep, s, 0.0).sum(-1)
    for name, got, want in (("teacher_mass", out.teacher_mass, teacher), ("student_mass", out.student_mass, student)):
        assert got.dtype == torch.float32 and got.shape == (3, 5) and not got.requires_grad, name
        check(got, want, 1e-6, name=name)
        assert bool((got[target == -100] == 0).all()), name
    hidden, weight, _ = make_linear((3, 5), HIDDEN, V)
    lin = fusedce.linear_topk_distillation_loss(hidden, weight, ids, lp, target, tail=tail, return_stats=True,
                                                method="tiled", backend=backend)
    s = torch.log_softmax(hidden.detach().double() @ weight.detach().double().T, -1).exp()
    check(lin.student_mass, torch.where(keep, s.gather(-1, torch.where(keep, ids, 0)), 0.0).sum(-1), 1e-6,
          name="linear student_mass")
    check(lin.teacher_mass, teacher, 1e-6, name="linear teacher_mass")


def test_teacher_values_are_checked():
    logits = torch.randn(3, 10, requires_grad=True)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    lp = torch.log(torch.tensor([[0.5, 0.2], [0.3, 0.3], [0.1, 0.6]]))
    hidden, weight, _ = make_linear((3,), 4, 10)
    ops = (lambda ids, lp, **kw: fusedce.topk_distillation_loss(logits, ids, lp, **kw),
           lambda ids, lp, **kw: fusedce.linear_topk_distillation_loss(hidden, weight, ids, lp, **kw))
    for op in ops:
        for tail in (False, True):
            with pytest.raises(ValueError, match=r"teacher_log_probs\[1, 0\] = 0\.3 > 0.*probabilities or logits"):
                op(ids, torch.where(torch.arange(3)[:, None] == 1, lp.exp(), lp), tail=tail)   # row 1 as probabilities
            with pytest.raises(ValueError, match=r"teacher_log_probs\[2, 1\] = inf"):
                op(ids, torch.where(torch.tensor([[False, False], [False, False], [False, True]]), float("inf"), lp),
                   tail=tail)
        over = lp.clone()
        over[2] = torch.tensor([0.6, 0.5]).log()   # sums to 1.1: not normalized over the vocabulary
        with pytest.raises(ValueError, match=r"teacher_log_probs\[2\].*sum to 1\.1.*tail=True"):
            op(ids, over, tail=True)
        op(ids, over)   # tail=False: K log-probs need not be normalized (axolotl's convention)
        # padding entries and ignored tokens are not looked at
        padded = lp.clone()
        padded[0, 1] = 3.0
        op(torch.tensor([[0, -100], [2, 3], [4, 5]]), padded, tail=True)   # an ignore_index id: padding
        op(ids, padded, target=torch.tensor([-100, 1, 2]), tail=True)      # an ignored token
    assert logits.grad is None


def test_value_checks_skipped_when_no_sync(monkeypatch):
    """Under torch.compile (``is_compiling``) the value check cannot host-sync: skipped, as the target-range
    check; a positive log-prob then enters the formula as given."""
    logits = torch.randn(3, 10)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    lp = torch.tensor([[0.5, -2.0], [-1.0, -1.5], [-0.5, -3.0]])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    loss = fusedce.topk_distillation_loss(logits, ids, lp, reduction="none", backend="torch")
    assert bool(torch.isfinite(loss).all())


def test_tail_flag_errors():
    logits, ids, lp = torch.randn(3, 10), torch.tensor([[0, 1]] * 3), torch.full((3, 2), -1.0)
    hidden, weight, _ = make_linear((3,), 4, 10)
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="tail must be a Python bool"):
            fusedce.topk_distillation_loss(logits, ids, lp, tail=bad)
        with pytest.raises(TypeError, match="return_stats must be a Python bool"):
            fusedce.linear_topk_distillation_loss(hidden, weight, ids, lp, return_stats=bad)
    with pytest.raises(TypeError, match=r"'tail'.*fusedce\.topk_distillation_loss\(\.\.\., tail=True\)"):
        fusedce.distillation_loss(logits, logits, tail=True)
    with pytest.raises(TypeError, match=r"'tail'.*fusedce\.linear_topk_distillation_loss"):
        fusedce.linear_distillation_loss(hidden, weight, hidden, weight, tail=True)


@pytest.mark.parametrize("form", ["logits", "chunked", "tiled"])
def test_second_backward_through_a_retained_graph(backend, form):
    """``autograd.grad`` with ``retain_graph=True``, then ``backward``: the same gradient twice (the tail
    pass keeps what it saved)."""
    ids, lp = make_teacher((2, 7), seed=6)
    if form == "logits":
        leaf = (torch.randn(2, 7, V) * 2).requires_grad_()
        loss = fusedce.topk_distillation_loss(leaf, ids, lp, tail=True, backend=backend)
    else:
        leaf, weight, _ = make_linear((2, 7), HIDDEN, V)
        loss = fusedce.linear_topk_distillation_loss(leaf, weight.detach(), ids, lp, tail=True, method=form,
                                                     backend=backend)
    first, = torch.autograd.grad(loss, leaf, retain_graph=True)
    loss.backward()
    assert torch.equal(first, leaf.grad) and bool(first.abs().sum() > 0)
