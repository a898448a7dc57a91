"""RL ops with K classes per token: ``token_log_probs`` / ``linear_token_log_probs`` with a ``(..., K)``
target, against float64 ``log_softmax(...).gather(-1, target)`` written from the formula (TRL's
``selective_log_softmax`` with a (..., K) index), both backends, both linear methods, fp32 / bf16 /
fp16, temperature and softcap, per-entry upstream gradients plus an entropy bonus, ignored entries and
rows, duplicate classes in a row, poisoned allocations, empty and all-ignored batches, K = 1 against the
one-class op, errors.

Shapes: V = 300 (not a multiple of the Triton block: the last block is partial); K = 5 (not a power
of two); leading (3, 7) / (2, 9) tokens (odd, several chunks of 5 rows with chunk_size=5)."""
import pytest
import torch

import fusedce
from fusedce.backends.pytorch import tuning as torch_tuning
from inputs import DTYPE_IDS, DTYPES, poisoned_allocations
from reference64_linear import make_linear
from reference64_log_probs import reference_log_probs
from tolerances import FP32_MATH_ATOL, GRAD_RTOL

HIDDEN, V, K = 16, 300, 5
SETTINGS = {"plain": (1.0, None), "t0.7": (0.7, None), "t1.3_cap5": (1.3, 5.0)}


@pytest.fixture(autouse=True)
def tiny_tiles(monkeypatch):
    monkeypatch.setattr(torch_tuning, "TILE_ROWS", 4)
    monkeypatch.setattr(torch_tuning, "TILE_VOCAB", 64)


def make_targets(lead, n_classes=V, k=K, ignore_index=-100):
    """Random (..., K) classes: the first and last class in row 0, a duplicate class in row 1, one
    ignored entry every 4th row, one wholly ignored row (the third)."""
    t = torch.randint(0, n_classes, (*lead, k)).reshape(-1, k)
    t[0, 0], t[0, -1] = 0, n_classes - 1
    if t.shape[0] > 1 and k > 1:
        t[1, 1] = t[1, 0]
    t[::4, k // 2] = ignore_index
    if t.shape[0] > 2:
        t[2] = ignore_index
    return t.reshape(*lead, k)


def objective(log_probs, entropy, g, beta):
    return (g * log_probs).sum() - (beta * entropy).sum()


def check(actual, expected, atol, rtol=0.0, name=""):
    err = (actual.detach().double() - expected).abs().max().item() if expected.numel() else 0.0
    bound = atol + rtol * (expected.abs().max().item() if expected.numel() else 0.0)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_token_log_probs_k(backend, setting, dtype):
    temperature, softcap = SETTINGS[setting]
    logits = (torch.randn(3, 7, V) * 4).to(dtype).requires_grad_()
    target = make_targets((3, 7))
    with poisoned_allocations():
        out = fusedce.token_log_probs(logits, target, temperature=temperature, softcap=softcap,
                                      return_entropy=True, backend=backend)
        g, beta = torch.randn(target.shape), torch.rand(target.shape[:-1])
        objective(out.log_probs, out.entropy, g, beta).backward()
    assert out.log_probs.dtype == torch.float32 and out.log_probs.shape == target.shape
    assert out.entropy.shape == target.shape[:-1]
    x64 = logits.detach().double().requires_grad_()
    ref_lp, ref_ent = reference_log_probs(x64, target, temperature, softcap)
    check(out.log_probs, ref_lp.detach(), FP32_MATH_ATOL, name="log_probs")
    check(out.entropy, ref_ent.detach(), FP32_MATH_ATOL, name="entropy")
    objective(ref_lp, ref_ent, g.double(), beta.double()).backward()
    assert logits.grad.dtype == dtype
    check(logits.grad, x64.grad, 1e-6, GRAD_RTOL[dtype], "grad")
    ignored = target == -100
    assert bool((out.log_probs[ignored] == 0).all())
    row_ignored = ignored.all(-1)
    assert bool((logits.grad[row_ignored] == 0).all()) and bool((out.entropy[row_ignored] == 0).all())


@pytest.mark.parametrize("method", ["chunked", "tiled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("setting", ["plain", "t1.3_cap5"])
def test_linear_token_log_probs_k(backend, setting, dtype, method):
    temperature, softcap = SETTINGS[setting]
    hidden, weight, bias = make_linear((2, 9), HIDDEN, V, dtype, bias=True, logit_scale=4.0)
    target = make_targets((2, 9))
    with poisoned_allocations():
        out = fusedce.linear_token_log_probs(hidden, weight, target, bias, temperature=temperature,
                                             softcap=softcap, return_entropy=True, method=method,
                                             backend=backend, chunk_size=5 if method == "chunked" else None)
        g, beta = torch.randn(target.shape), torch.rand(target.shape[:-1])
        objective(out.log_probs, out.entropy, g, beta).backward()
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    exact = torch.nn.functional.linear(*leaves)   # fp32 logits from the same values: never rounded to the dtype
    ref_lp, ref_ent = reference_log_probs(exact, target, temperature, softcap)
    check(out.log_probs, ref_lp.detach(), FP32_MATH_ATOL, name="log_probs")
    check(out.entropy, ref_ent.detach(), FP32_MATH_ATOL, name="entropy")
    objective(ref_lp, ref_ent, g.double(), beta.double()).backward()
    for name, t, ref in zip(("hidden", "weight", "bias"), (hidden, weight, bias), leaves):
        assert t.grad.dtype == dtype
        check(t.grad, ref.grad, 1e-6, GRAD_RTOL[dtype], f"grad_{name}")
    assert bool((hidden.grad[(target == -100).all(-1)] == 0).all())


@pytest.mark.parametrize("method", [None, "chunked", "tiled"])
def test_k1_equals_the_one_class_op(backend, method):
    """A (..., 1) target gives the one-class op's log-probs, entropy and gradients (same kernels and
    statistics; the target logit gathered in torch, so a few fp32 ulps apart with softcap)."""
    target1 = make_targets((11,), k=1)
    g, beta = torch.randn(11), torch.rand(11)
    grads = []
    for target in (target1, target1[:, 0]):
        if method is None:
            leaves = [(torch.randn(11, V, generator=torch.Generator().manual_seed(1)) * 3).requires_grad_()]
            out = fusedce.token_log_probs(leaves[0], target, temperature=0.9, softcap=7.0, return_entropy=True,
                                          backend=backend)
        else:
            torch.manual_seed(2)
            leaves = list(make_linear((11,), HIDDEN, V, bias=True))
            out = fusedce.linear_token_log_probs(*leaves[:2], target, leaves[2], temperature=0.9, softcap=7.0,
                                                 return_entropy=True, method=method, backend=backend)
        objective(out.log_probs.reshape(11), out.entropy, g, beta).backward()
        grads.append((out.log_probs.reshape(11), out.entropy, *[t.grad for t in leaves]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_all_ignored_and_empty(backend):
    for lead in ((4,), (0,)):
        logits = torch.randn(*lead, V).requires_grad_()
        target = torch.full((*lead, K), -100, dtype=torch.int64)
        out = fusedce.token_log_probs(logits, target, return_entropy=True, backend=backend)
        assert out.log_probs.shape == (*lead, K) and out.entropy.shape == lead
        assert bool((out.log_probs == 0).all()) and bool((out.entropy == 0).all())
        (out.log_probs.sum() + out.entropy.sum()).backward()
        assert bool((logits.grad == 0).all())
        hidden, weight, bias = make_linear(lead, HIDDEN, V, bias=True)
        for method in ("chunked", "tiled"):
            out = fusedce.linear_token_log_probs(hidden, weight, target, bias, return_entropy=True, method=method,
                                                 backend=backend)
            assert out.log_probs.shape == (*lead, K) and out.entropy.shape == lead
            assert bool((out.log_probs == 0).all()) and bool((out.entropy == 0).all())
            (out.log_probs.sum() + out.entropy.sum()).backward()
            assert bool((hidden.grad == 0).all()) and bool((weight.grad == 0).all()) and bool((bias.grad == 0).all())
            hidden.grad = weight.grad = bias.grad = None


def test_log_probs_only_and_int32(backend):
    """Without the entropy a tensor is returned; an int32 target works; the caller's target is unchanged."""
    logits = torch.randn(6, V) * 2
    target = make_targets((6,)).to(torch.int32)
    before = target.clone()
    lp = fusedce.token_log_probs(logits, target, temperature=1.5, backend=backend)
    assert isinstance(lp, torch.Tensor) and lp.shape == (6, K)
    assert torch.equal(target, before)
    check(lp, reference_log_probs(logits.double(), target.long(), 1.5, None)[0], FP32_MATH_ATOL, name="log_probs")


def test_a_backend_without_the_k_form_is_refused(monkeypatch):
    """A backend without the RL kernels (``Capabilities.entropy`` False: CuTe) is refused at the call,
    checked when the backend is resolved (the resolution itself is faked: no CUDA here)."""
    from fusedce import backends
    real = backends.resolve
    monkeypatch.setattr(backends, "resolve", lambda name, device: "cute" if name == "cute" else real(name, device))
    logits, target = torch.randn(3, 10), torch.randint(0, 10, (3, 2))
    with pytest.raises(RuntimeError, match="backend='cute' has no entropy"):
        fusedce.token_log_probs(logits, target, backend="cute")
    hidden, weight, _ = make_linear((3,), 4, 10)
    with pytest.raises(RuntimeError, match="backend='cute' has no entropy"):
        fusedce.linear_token_log_probs(hidden, weight, target, backend="cute")


def test_errors():
    logits = torch.randn(3, 10)
    hidden, weight, _ = make_linear((3,), 4, 10)
    with pytest.raises(IndexError):
        fusedce.token_log_probs(logits, torch.tensor([[0, 1], [10, 2], [3, 4]]))
    with pytest.raises(IndexError):
        fusedce.linear_token_log_probs(hidden, weight, torch.tensor([[0, 1], [-2, 2], [3, 4]]))
    with pytest.raises(ValueError, match="K >= 1"):
        fusedce.token_log_probs(logits, torch.zeros(3, 0, dtype=torch.int64))
    with pytest.raises(ValueError, match="K >= 1"):
        fusedce.linear_token_log_probs(hidden, weight, torch.zeros(3, 0, dtype=torch.int64))
    with pytest.raises(ValueError, match="shape"):
        fusedce.token_log_probs(logits, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="shape"):
        fusedce.linear_token_log_probs(hidden, weight, torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="int64 or int32"):
        fusedce.token_log_probs(logits, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="return_stats"):
        fusedce.token_log_probs(logits, torch.zeros(3, 2, dtype=torch.int64), return_stats=True)
    with pytest.raises(ValueError, match="temperature"):
        fusedce.token_log_probs(logits, torch.zeros(3, 2, dtype=torch.int64), temperature=0.0)


@pytest.mark.parametrize("method", [None, "chunked", "tiled"])
def test_backward_twice(backend, method):
    """A second backward through a retained graph gives the first one's gradient; create_graph raises."""
    target = make_targets((7,))
    if method is None:
        leaf = (torch.randn(7, V) * 2).requires_grad_()
        out = fusedce.token_log_probs(leaf, target, temperature=0.8, return_entropy=True, backend=backend)
    else:
        leaf, weight, _ = make_linear((7,), HIDDEN, V)
        out = fusedce.linear_token_log_probs(leaf, weight, target, temperature=0.8, return_entropy=True,
                                             method=method, backend=backend)
    loss = objective(out.log_probs, out.entropy, torch.randn(target.shape), torch.rand(7))
    first = torch.autograd.grad(loss, leaf, retain_graph=True)[0]
    second = torch.autograd.grad(loss, leaf, retain_graph=True)[0]
    assert torch.equal(first, second)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, leaf, create_graph=True)


def test_tiled_deterministic(backend):
    """``deterministic=True``: the tiled method's K-class weight / bias terms go through the sorted
    segment sum (duplicate classes across rows and within a row), same gradients as the reference."""
    hidden, weight, bias = make_linear((9,), HIDDEN, V, bias=True)
    target = make_targets((9,))
    target[4:, 0] = 7   # one class in many rows
    out = fusedce.linear_token_log_probs(hidden, weight, target, bias, temperature=0.9, method="tiled",
                                         backend=backend, deterministic=True)
    g = torch.randn(target.shape)
    (g * out).sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    ref, _ = reference_log_probs(torch.nn.functional.linear(*leaves), target, 0.9, None)
    (g.double() * ref).sum().backward()
    for name, t, r in zip(("hidden", "weight", "bias"), (hidden, weight, bias), leaves):
        check(t.grad, r.grad, 1e-6, GRAD_RTOL[torch.float32], f"grad_{name}")
