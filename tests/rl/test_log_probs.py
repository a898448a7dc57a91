"""RL: ``token_log_probs`` / ``linear_token_log_probs`` (log-probs and entropy at a temperature, with
softcap) against float64 ``log_softmax``, both backends, both linear methods, fp32 / bf16 / fp16,
per-token upstream gradients for both outputs at once, ignored rows (0, exactly zero gradient),
all-ignored and empty batches, errors."""
import pytest
import torch

import fusedce
from fusedce.backends.pytorch import tuning as torch_tuning
from inputs import DTYPE_IDS, DTYPES, make_target
from reference64_linear import make_linear
from reference64_log_probs import reference_log_probs
from tolerances import FP32_MATH_ATOL, GRAD_RTOL

HIDDEN, V = 16, 300
# (temperature, softcap)
SETTINGS = {"plain": (1.0, None), "t0.7": (0.7, None), "t1.3_cap5": (1.3, 5.0), "t0.5_cap30": (0.5, 30.0)}


@pytest.fixture(autouse=True)
def tiny_tiles(monkeypatch):
    monkeypatch.setattr(torch_tuning, "TILE_ROWS", 4)
    monkeypatch.setattr(torch_tuning, "TILE_VOCAB", 64)


def _objective(log_probs, entropy, adv, beta):
    """A GRPO-style objective: per-token advantages on the log-probs plus an entropy bonus."""
    return -(adv * log_probs).sum() - (beta * entropy).sum()


def _check(actual, expected, atol, rtol=0.0, name=""):
    actual64 = actual.detach().double()
    bound = atol + rtol * expected.abs().max().item()
    err = (actual64 - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_token_log_probs(backend, setting, dtype):
    temperature, softcap = SETTINGS[setting]
    logits = (torch.randn(3, 7, V) * 4).to(dtype).requires_grad_()
    target = make_target((3, 7), V, ignore_every=4)
    out = fusedce.token_log_probs(logits, target, temperature=temperature, softcap=softcap, return_entropy=True,
                                  backend=backend)
    assert isinstance(out, fusedce.TokenLogProbs)
    assert out.log_probs.dtype == torch.float32 and out.log_probs.shape == target.shape
    x64 = logits.detach().double().requires_grad_()
    ref_lp, ref_ent = reference_log_probs(x64, target, temperature, softcap)
    _check(out.log_probs, ref_lp.detach(), FP32_MATH_ATOL, name="log_probs")
    _check(out.entropy, ref_ent.detach(), FP32_MATH_ATOL, name="entropy")
    adv, beta = torch.randn(target.shape), torch.rand(target.shape)
    _objective(out.log_probs, out.entropy, adv, beta).backward()
    _objective(ref_lp, ref_ent, adv.double(), beta.double()).backward()
    assert logits.grad.dtype == dtype
    _check(logits.grad, x64.grad, 1e-6, GRAD_RTOL[dtype], "grad")
    ignored = target == -100
    assert bool((logits.grad[ignored] == 0).all()) and bool((out.log_probs[ignored] == 0).all())
    assert bool((out.entropy[ignored] == 0).all())


@pytest.mark.parametrize("setting", ["plain", "t1.3_cap5"])
def test_masked_vocabulary_logits(backend, setting):
    """``-inf`` logits (a masked vocabulary; the reference's rule: probability 0, entropy term 0, gradient
    0): finite log-probs and entropy equal to float64's, no NaN in any output or gradient, exactly 0
    gradient on the masked columns."""
    temperature, softcap = SETTINGS[setting]
    x = torch.randn(6, V) * 4
    x[:, 200:] = float("-inf")   # the last 100 classes masked on every row
    x[2, :150] = float("-inf")   # and most of one row's other classes
    target = make_target((6,), 200, ignore_every=4)
    target[2] = 170
    logits = x.clone().requires_grad_()
    out = fusedce.token_log_probs(logits, target, temperature=temperature, softcap=softcap, return_entropy=True,
                                  backend=backend)
    x64 = x.double().requires_grad_()
    ref_lp, ref_ent = reference_log_probs(x64, target, temperature, softcap)
    assert not bool(ref_ent.isnan().any()) and not bool(out.entropy.isnan().any())
    _check(out.log_probs, ref_lp.detach(), FP32_MATH_ATOL, name="log_probs")
    _check(out.entropy, ref_ent.detach(), FP32_MATH_ATOL, name="entropy")
    adv, beta = torch.randn(target.shape), torch.rand(target.shape)
    _objective(out.log_probs, out.entropy, adv, beta).backward()
    _objective(ref_lp, ref_ent, adv.double(), beta.double()).backward()
    assert not bool(x64.grad.isnan().any()) and not bool(logits.grad.isnan().any())
    _check(logits.grad, x64.grad, 1e-6, GRAD_RTOL[torch.float32], "grad")
    assert bool((logits.grad[:, 200:] == 0).all()) and bool((logits.grad[2, :150] == 0).all())


@pytest.mark.parametrize("method", ["chunked", "tiled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("setting", ["plain", "t1.3_cap5"])
def test_linear_token_log_probs(backend, setting, dtype, method):
    temperature, softcap = SETTINGS[setting]
    hidden, weight, bias = make_linear((2, 9), HIDDEN, V, dtype, bias=True, logit_scale=4.0)
    target = make_target((2, 9), V, ignore_every=3)
    out = fusedce.linear_token_log_probs(hidden, weight, target, bias, temperature=temperature, softcap=softcap,
                                         return_entropy=True, method=method, backend=backend,
                                         chunk_size=5 if method == "chunked" else None)
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    exact = torch.nn.functional.linear(*leaves)   # fp32 logits from the same values: never rounded to the dtype
    ref_lp, ref_ent = reference_log_probs(exact, target, temperature, softcap)
    _check(out.log_probs, ref_lp.detach(), FP32_MATH_ATOL, name="log_probs")
    _check(out.entropy, ref_ent.detach(), FP32_MATH_ATOL, name="entropy")
    adv, beta = torch.randn(target.shape), torch.rand(target.shape)
    _objective(out.log_probs, out.entropy, adv, beta).backward()
    _objective(ref_lp, ref_ent, adv.double(), beta.double()).backward()
    for t, ref in zip((hidden, weight, bias), leaves):
        assert t.grad.dtype == dtype
        _check(t.grad, ref.grad, 1e-6, GRAD_RTOL[dtype], "grad")
    assert bool((hidden.grad[target == -100] == 0).all())


@pytest.mark.parametrize("which", ["log_probs", "entropy"])
def test_one_output_only(backend, which):
    """Only one output takes part in the loss (the other's upstream gradient is None)."""
    logits = (torch.randn(6, V) * 3).requires_grad_()
    target = make_target((6,), V, ignore_every=3)
    out = fusedce.token_log_probs(logits, target, temperature=0.8, return_entropy=True, backend=backend)
    getattr(out, which).sum().backward()
    x64 = logits.detach().double().requires_grad_()
    dict(zip(("log_probs", "entropy"), reference_log_probs(x64, target, 0.8, None)))[which].sum().backward()
    _check(logits.grad, x64.grad, 1e-6, 1e-4, which)


def test_without_entropy_returns_a_tensor(backend):
    hidden, weight, _ = make_linear((5,), HIDDEN, V)
    target = make_target((5,), V)
    for method in ("chunked", "tiled"):
        lp = fusedce.linear_token_log_probs(hidden, weight, target, method=method, backend=backend)
        assert isinstance(lp, torch.Tensor) and lp.shape == (5,)
        torch.testing.assert_close(lp, -fusedce.linear_cross_entropy(hidden, weight, target, reduction="none",
                                                                     backend=backend), rtol=1e-5, atol=1e-6)


def test_all_ignored_and_empty(backend):
    for lead in ((4,), (0,)):
        hidden, weight, bias = make_linear(lead, HIDDEN, V, bias=True)
        target = torch.full(lead, -100, dtype=torch.int64)
        for method in ("chunked", "tiled"):
            out = fusedce.linear_token_log_probs(hidden, weight, target, bias, return_entropy=True, method=method,
                                                 backend=backend)
            assert bool((out.log_probs == 0).all()) and bool((out.entropy == 0).all())
            (out.log_probs.sum() + out.entropy.sum()).backward()
            assert bool((hidden.grad == 0).all()) and bool((weight.grad == 0).all())
            hidden.grad = weight.grad = bias.grad = None


def test_a_backend_without_entropy_kernels_is_refused(monkeypatch):
    """A backend without the RL kernels (``Capabilities.entropy`` False: CuTe) is refused at the call,
    checked when the backend is resolved (the resolution itself is faked: no CUDA here)."""
    from fusedce import backends
    real = backends.resolve
    monkeypatch.setattr(backends, "resolve", lambda name, device: "cute" if name == "cute" else real(name, device))
    logits, target = torch.randn(3, 10), torch.randint(0, 10, (3,))
    with pytest.raises(RuntimeError, match="backend='cute' has no entropy"):
        fusedce.token_log_probs(logits, target, backend="cute")
    hidden, weight, _ = make_linear((3,), 4, 10)
    with pytest.raises(RuntimeError, match="backend='cute' has no entropy"):
        fusedce.linear_token_log_probs(hidden, weight, target, backend="cute")


def test_errors():
    logits, target = torch.randn(3, 10), torch.randint(0, 10, (3,))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            fusedce.token_log_probs(logits, target, temperature=bad)
    for bad in (1e38, 1e-39):   # 1 / temperature not a normal fp32 number
        with pytest.raises(ValueError, match="temperature"):
            fusedce.token_log_probs(logits, target, temperature=bad)
    with pytest.raises(ValueError, match="softcap / temperature"):   # 1e39: beyond fp32
        fusedce.token_log_probs(logits, target, temperature=0.01, softcap=1e37)
    with pytest.raises(TypeError, match="temperature"):
        fusedce.token_log_probs(logits, target, temperature="hot")
    with pytest.raises(ValueError, match="softcap"):
        fusedce.token_log_probs(logits, target, softcap=0.0)
    with pytest.raises(IndexError):
        fusedce.token_log_probs(logits, torch.tensor([0, 10, 1]))
    with pytest.raises(TypeError, match="return_entropy"):
        fusedce.token_log_probs(logits, target, return_entropy=1)
    hidden, weight, _ = make_linear((3,), 4, 10)
    with pytest.raises(ValueError, match="chunk_size"):
        fusedce.linear_token_log_probs(hidden, weight, target, method="tiled", chunk_size=2)
    with pytest.raises(ValueError, match="method"):
        fusedce.linear_token_log_probs(hidden, weight, target, method="other")
    with pytest.raises(ValueError, match="shape"):
        fusedce.linear_token_log_probs(hidden, weight, target[:2])


def test_swapped_logits_and_target_are_named():
    """Fresh-user finding: ``token_log_probs(target, logits)`` said only "logits must be float32"."""
    logits, target = torch.randn(3, 10), torch.randint(0, 10, (3,))
    with pytest.raises(TypeError, match=r"got torch\.int64, and target is torch\.float32: logits and target swapped\? "
                                        r"pass \(logits, target\)"):
        fusedce.token_log_probs(target, logits)
    with pytest.raises(TypeError, match=r"logits must be float32, bfloat16 or float16, got torch\.int64$"):
        fusedce.token_log_probs(target, target)   # no float target: no swap suggested


def test_target_shape_error_names_the_k_class_form():
    """A target of the wrong shape: the message names both accepted forms, ``(...)`` and ``(..., K)``."""
    with pytest.raises(ValueError, match=r"must equal \(10,\); or a \(\.\.\., K\) target of 2 dimensions"):
        fusedce.token_log_probs(torch.randn(10, 37), torch.randint(0, 37, (10, 3, 2)))


@pytest.mark.parametrize("shape", [(10,), (10, 37)], ids=["tokens", "tokens_by_vocab"])
def test_float_target_of_the_linear_op_names_class_indices_only(shape):
    """``linear_token_log_probs`` takes class indices only: a float target's TypeError does not offer
    class probabilities (which ``linear_cross_entropy`` takes)."""
    hidden, weight = torch.randn(10, 8), torch.randn(37, 8)
    with pytest.raises(TypeError, match=r"target must be int64 or int32, got torch.float32") as info:
        fusedce.linear_token_log_probs(hidden, weight, torch.rand(shape))
    assert "pass target.long(); this op takes no class probabilities" in str(info.value)
    with pytest.raises(TypeError, match=r"or a float32 .* \(class probabilities\)"):   # the op that takes them
        fusedce.linear_cross_entropy(hidden, weight, torch.zeros(10, dtype=torch.bool))
