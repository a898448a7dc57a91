"""Top-k teacher distillation: ``topk_distillation_loss`` / ``linear_topk_distillation_loss`` against a
float64 reference written from the formula (per token ``sum_k p_k (log p_k - log s[id_k])``, ``p`` the
stored teacher probabilities, ``s = softmax(c(z_s) / T)``, plus ``hard_label_weight * CE(c(z_s))``),
both backends, every method, fp32 / bf16 / fp16, every reduction, padding entries (-inf log-probs and
``ignore_index`` ids), ignored tokens, poisoned allocations, empty and all-ignored batches, K = V equal
to the full forward KL of ``reference64_distill``, K = 1 from the one-class op, bad inputs.

Shapes: V = 300 (a partial last Triton block), K = 6, leading (3, 5) / (2, 7) tokens (odd; chunks of 4
rows with chunk_size=4)."""
import pytest
import torch

import fusedce
from inputs import DTYPE_IDS, DTYPES, poisoned_allocations
from reference64_distill import distill_rows64
from reference64_linear import make_linear
from tolerances import FP32_MATH_ATOL, GRAD_RTOL
from topk_cases import HIDDEN, K, V, check, make_hard_target, tiny_tiles  # noqa: F401 (tiny_tiles: an autouse fixture)

# (temperature, hard_label_weight, student_softcap)
SETTINGS = {"plain": (1.0, 0.0, None), "hard_folded": (1.0, 0.5, None), "t2_hard_cap": (2.0, 0.3, 8.0),
            "t0.7": (0.7, 0.0, None)}


def make_teacher(lead, k=K, n_classes=V, ignore_index=-100):
    """The top-k of a random teacher distribution (ids, fp32 log-probs (..., k)), not renormalized; one
    entry in every third token padded with -inf (id 0, as TRL's server pads), one with ``ignore_index``."""
    teacher = torch.log_softmax(torch.randn(*lead, n_classes) * 3, dim=-1)
    lp, ids = teacher.topk(k, dim=-1)
    lp, ids = lp.reshape(-1, k).clone(), ids.reshape(-1, k).clone()
    lp[::3, -1], ids[::3, -1] = float("-inf"), 0
    if lp.shape[0] > 1:
        ids[1, 0] = ignore_index
    return ids.reshape(*lead, k), lp.reshape(*lead, k)


def reference_rows(z64, ids, lp, target, temperature, hard_label_weight, softcap, ignore_index=-100):
    """float64 per-token loss from the formula (0 on ignored tokens)."""
    z = z64 if softcap is None else softcap * torch.tanh(z64 / softcap)
    log_s = torch.log_softmax(z / temperature, dim=-1)
    lp64 = lp.double()
    keep = (lp64 != float("-inf")) & (ids != ignore_index)
    s_k = log_s.gather(-1, torch.where(keep, ids, 0))
    rows = torch.where(keep, lp64.exp() * (torch.where(keep, lp64, 0.0) - s_k), 0.0).sum(-1)
    if target is None:
        return rows
    valid = target != ignore_index
    if hard_label_weight:
        ce = -torch.log_softmax(z, dim=-1).gather(-1, torch.where(valid, target, 0)[..., None])[..., 0]
        rows = rows + hard_label_weight * ce
    return torch.where(valid, rows, 0.0)


def reduce64(rows, target, reduction, num_items=None, ignore_index=-100):
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    d = num_items if num_items is not None else (
        rows.numel() if target is None else int((target != ignore_index).sum()))
    return rows.sum() / d if d else rows.sum() * 0.0


def upstream(loss):
    return torch.randn(loss.shape) if loss.dim() else torch.tensor(1.7)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_topk_distillation_loss(backend, setting, dtype, reduction):
    temperature, hard, cap = SETTINGS[setting]
    logits = (torch.randn(3, 5, V) * 3).to(dtype).requires_grad_()
    ids, lp = make_teacher((3, 5))
    lp = lp.requires_grad_()   # a constant all the same: it must get no gradient
    target = make_hard_target((3, 5))
    before = (ids.clone(), lp.detach().clone(), target.clone())
    with poisoned_allocations():
        loss = fusedce.topk_distillation_loss(logits, ids, lp, target, temperature=temperature, hard_label_weight=hard,
                                              reduction=reduction, student_softcap=cap, backend=backend)
        g = upstream(loss)
        loss.backward(g)
    assert loss.dtype == torch.float32 and loss.shape == (() if reduction != "none" else target.shape)
    x64 = logits.detach().double().requires_grad_()
    ref = reduce64(reference_rows(x64, ids, lp.detach(), target, temperature, hard, cap), target, reduction)
    check(loss, ref.detach(), FP32_MATH_ATOL * max(1.0, ref.detach().abs().max().item()), name="loss")
    ref.backward(g.double())
    assert logits.grad.dtype == dtype
    check(logits.grad, x64.grad, 1e-6, GRAD_RTOL[dtype], "grad")
    assert bool((logits.grad[target == -100] == 0).all())
    assert lp.grad is None
    assert all(torch.equal(a, b) for a, b in zip(before, (ids, lp.detach(), target)))


@pytest.mark.parametrize("method", ["chunked", "tiled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("setting", ["hard_folded", "t2_hard_cap"])
def test_linear_topk_distillation_loss(backend, setting, dtype, method):
    temperature, hard, cap = SETTINGS[setting]
    hidden, weight, bias = make_linear((2, 7), HIDDEN, V, dtype, bias=True, logit_scale=4.0)
    ids, lp = make_teacher((2, 7))
    target = make_hard_target((2, 7))
    with poisoned_allocations():
        loss = fusedce.linear_topk_distillation_loss(hidden, weight, ids, lp, target, student_bias=bias,
                                                     temperature=temperature, hard_label_weight=hard,
                                                     student_softcap=cap, method=method, backend=backend,
                                                     chunk_size=4 if method == "chunked" else None)
        loss.backward()
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    # the fused op forms fp32 logits from the operands' values (issue 29): the float64 logits of the same values
    exact = torch.nn.functional.linear(*leaves)
    ref = reduce64(reference_rows(exact, ids, lp, target, temperature, hard, cap), target, "mean")
    check(loss, ref.detach(), FP32_MATH_ATOL, name="loss")
    ref.backward()
    for name, t, r in zip(("hidden", "weight", "bias"), (hidden, weight, bias), leaves):
        assert t.grad.dtype == dtype
        check(t.grad, r.grad, 1e-6, GRAD_RTOL[dtype], f"grad_{name}")
    assert bool((hidden.grad[target == -100] == 0).all())


def test_full_support_is_the_forward_kl(backend):
    """K = V with the teacher's whole distribution: the forward KL of the full-logit oracle (beta = 0)."""
    student = (torch.randn(9, V) * 2).requires_grad_()
    teacher = torch.randn(9, V) * 2
    lp, ids = torch.log_softmax(teacher / 1.5, dim=-1).sort(dim=-1, descending=True)
    target = make_hard_target((9,))
    loss = fusedce.topk_distillation_loss(student, ids, lp, target, temperature=1.5, hard_label_weight=0.25,
                                          reduction="none", backend=backend)
    ref = distill_rows64(student.detach().double(), teacher.double(), target, beta=0.0, temperature=1.5,
                         hard_label_weight=0.25)
    check(loss, ref, FP32_MATH_ATOL, name="loss")


def test_k1_from_the_one_class_op(backend):
    logits = torch.randn(8, V) * 2
    ids, lp = make_teacher((8,), k=1)
    loss = fusedce.topk_distillation_loss(logits, ids, lp, temperature=0.8, reduction="none", backend=backend)
    keep = (lp[:, 0] != float("-inf")) & (ids[:, 0] != -100)
    one = fusedce.token_log_probs(logits, torch.where(keep, ids[:, 0], -100), temperature=0.8, backend=backend)
    expected = torch.where(keep, lp[:, 0].exp() * (torch.where(keep, lp[:, 0], 0.0) - one), 0.0)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)


def test_num_items_in_batch_and_no_target(backend):
    logits = (torch.randn(4, 3, V) * 2).requires_grad_()
    ids, lp = make_teacher((4, 3))
    loss = fusedce.topk_distillation_loss(logits, ids, lp, num_items_in_batch=5, backend=backend)
    rows = reference_rows(logits.detach().double(), ids, lp, None, 1.0, 0.0, None)
    check(loss, rows.sum() / 5, FP32_MATH_ATOL, name="num_items")
    loss = fusedce.topk_distillation_loss(logits, ids, lp, backend=backend)
    check(loss, rows.mean(), FP32_MATH_ATOL, name="mean without target")


def test_empty_and_all_ignored(backend):
    for lead in ((0,), (4,)):
        target = torch.full(lead, -100, dtype=torch.int64)
        ids, lp = make_teacher(lead) if lead[0] else (torch.zeros(0, K, dtype=torch.int64), torch.zeros(0, K))
        logits = torch.randn(*lead, V).requires_grad_()
        loss = fusedce.topk_distillation_loss(logits, ids, lp, target, hard_label_weight=0.5, backend=backend)
        assert loss.item() == 0.0
        loss.backward()
        assert bool((logits.grad == 0).all())
        hidden, weight, bias = make_linear(lead, HIDDEN, V, bias=True)
        for method in ("chunked", "tiled"):
            loss = fusedce.linear_topk_distillation_loss(hidden, weight, ids, lp, target, student_bias=bias,
                                                         temperature=2.0, hard_label_weight=0.5, method=method,
                                                         backend=backend)
            assert loss.item() == 0.0
            loss.backward()
            assert bool((hidden.grad == 0).all()) and bool((weight.grad == 0).all()) and bool((bias.grad == 0).all())
            hidden.grad = weight.grad = bias.grad = None


def test_errors():
    logits = torch.randn(3, 10)
    ids, lp = torch.randint(0, 10, (3, 2)), torch.randn(3, 2)
    f = fusedce.topk_distillation_loss
    with pytest.raises(TypeError, match="teacher_ids"):
        f(logits, ids.float(), lp)
    with pytest.raises(TypeError, match="teacher_log_probs"):
        f(logits, ids, ids)
    with pytest.raises(ValueError, match="same shape"):
        f(logits, ids, lp[:, :1])
    with pytest.raises(ValueError, match="leading shape"):
        f(logits, ids[:2], lp[:2])
    with pytest.raises(ValueError, match="K >= 1"):
        f(logits, ids[:, :0], lp[:, :0])
    with pytest.raises(IndexError, match=r"teacher_ids\[1, 0\] = 10 is out of range"):
        f(logits, torch.tensor([[0, 1], [10, 2], [3, 4]]), lp)
    with pytest.raises(IndexError, match=r"teacher_ids\[2, 1\] = 10"):   # with a folded hard label too
        f(logits, torch.tensor([[0, 1], [1, 2], [3, 10]]), lp, torch.tensor([0, 1, 2]), hard_label_weight=0.5)
    with pytest.raises(IndexError, match=r"target\[1\] = 11"):
        f(logits, ids, lp, torch.tensor([0, 11, 2]))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            f(logits, ids, lp, temperature=bad)
    with pytest.raises(ValueError, match="needs a target"):
        f(logits, ids, lp, hard_label_weight=0.5)
    with pytest.raises(ValueError, match="reduction"):
        f(logits, ids, lp, reduction="batchmean")
    with pytest.raises(ValueError, match="target shape"):
        f(logits, ids, lp, torch.zeros(4, dtype=torch.int64))
    hidden, weight, _ = make_linear((3,), 4, 10)
    g = fusedce.linear_topk_distillation_loss
    with pytest.raises(IndexError, match=r"teacher_ids\[1, 0\] = -5 is out of range"):
        g(hidden, weight, torch.tensor([[0, 1], [-5, 2], [3, 4]]), lp)
    with pytest.raises(ValueError, match="temperature"):
        g(hidden, weight, ids, lp, temperature=0.0)
    with pytest.raises(ValueError, match="student_weight"):
        g(hidden, weight[0], ids, lp)
    with pytest.raises(ValueError, match="chunk_size"):
        g(hidden, weight, ids, lp, method="tiled", chunk_size=2)
