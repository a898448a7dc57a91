"""``fusedce.linear_cross_entropy`` with probability ("soft") targets (issue 30): a float target (..., V)
with ``cross_entropy``'s probability-target semantics, both methods, every reduction and option, both
backends of this machine (Triton under the interpreter), against the float64 oracle ``reference64_soft``.

The oracle runs on the fp32 logits ``F.linear(h, W, b)`` (the values the fused paths form; a different
summation order in the tiled blocks moves them by an ulp, which the table's 64 fp32 units of ``K_r M_r``
cover). The gradients of hidden, weight and bias follow from the oracle's logits gradient ``G`` by the
chain rule in float64 (``G @ W``, ``G.T @ h``, ``sum_rows G``); each is allowed the propagated bound of
``G`` (tolerances.py's gradient bound through ``|W|``, ``|h|``) plus 64 fp32 units of the sums it runs
over (``|G| @ |W|``, ...: the chunk / block accumulation).

Shapes: (2, 4) = 8 tokens, H = 16, V = 75 (odd: partial vocabulary blocks; the PyTorch tiled loop's
blocks are 2 tokens x 37 classes, Triton's row kernels use 32-class blocks here, so each row spans three),
chunks of 3 tokens (a partial last chunk). Targets: softmax(randn * 2) rows, one one-hot row, one row with
zeros (not renormalized).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusedce
from inputs import make_weight, poisoned_allocations
from reference64_soft import reference_soft
from tolerances import FP32_UNITS, TOLERANCES, U32, _check, assert_loss_close

LEAD, H, V, CHUNK = (2, 4), 16, 75, 3
REDUCTIONS = ("mean", "sum", "none")
METHODS = ("chunked", "tiled")


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    from fusedce.backends.triton import tuning
    monkeypatch.setattr(tuning, "MAX_BLOCK_V", 32)


def make_case(q_dtype=torch.float32, bias=True, logit_scale=2.0):
    hidden = torch.randn(*LEAD, H).requires_grad_()
    weight = (torch.randn(V, H) * (logit_scale / H ** 0.5)).requires_grad_()
    b = (torch.randn(V) * 0.5).requires_grad_() if bias else None
    q = torch.softmax(torch.randn(*LEAD, V) * 2.0, dim=-1)
    qf = q.view(-1, V)
    qf[0] = F.one_hot(torch.tensor(V - 1), V).float()
    qf[1, ::3] = 0.0
    return hidden, weight, b, q.to(q_dtype)


def upstream_for(reduction):
    return torch.randn(LEAD) if reduction == "none" else 3.7


def check(backend, method, hidden, weight, bias, q, *, reduction, ce_weight=None, token_weights=None, **kw):
    upstream = upstream_for(reduction)
    ref_kw = {k: v for k, v in kw.items() if k not in ("return_stats",)}
    logits32 = F.linear(hidden.detach(), weight.detach(), None if bias is None else bias.detach())
    ref = reference_soft(logits32, q, ce_weight, reduction=reduction, upstream=upstream,
                         token_weights=token_weights, **ref_kw)
    q_before = q.clone()
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    with poisoned_allocations():
        out = fusedce.linear_cross_entropy(hidden, weight, q, bias, ce_weight=ce_weight, reduction=reduction,
                                           method=method, backend=backend, token_weights=token_weights,
                                           chunk_size=CHUNK if method == "chunked" else None, **kw)
        loss = out.loss if isinstance(out, fusedce.CrossEntropyOutput) else out
        up = upstream if isinstance(upstream, torch.Tensor) else torch.full_like(loss, float(upstream))
        grads = torch.autograd.grad(loss, inputs, up)
    assert_loss_close(loss.detach(), ref, torch.float32)
    tol = TOLERANCES[torch.float32]
    g = ref.grad.reshape(-1, V)
    g_bound = (tol.grad_rtol * g.abs() + FP32_UNITS * U32 * ref.grad_err_scale.reshape(-1, 1)).nan_to_num(0.0)
    h64, w64 = hidden.detach().double().reshape(-1, H), weight.detach().double()
    expected = {"hidden": (g @ w64, g_bound @ w64.abs() + FP32_UNITS * U32 * (g.abs() @ w64.abs())),
                "weight": (g.t() @ h64, g_bound.t() @ h64.abs() + FP32_UNITS * U32 * (g.abs().t() @ h64.abs())),
                "bias": (g.sum(0), g_bound.sum(0) + FP32_UNITS * U32 * g.abs().sum(0))}
    for name, grad in zip(("hidden", "weight", "bias"), grads):
        value, bound = expected[name]
        assert grad.dtype == torch.float32
        _check(f"grad_{name}", grad.reshape(value.shape), value, bound)
    assert torch.equal(q, q_before), "the caller's target was modified"
    return ref, out


OPTIONS = {
    "plain": {},
    "smoothing+weight": {"label_smoothing": 0.1, "ce_weight": True},
    "zloss+softcap+scale": {"lse_square_scale": 1e-2, "softcap": 5.0, "logit_scale": 1.5},
    "token_weights+num_items": {"token_weights": True, "lse_square_scale": 1e-2, "num_items_in_batch": 11},
    "everything": {"ce_weight": True, "label_smoothing": 0.2, "lse_square_scale": 1e-2, "softcap": 8.0,
                   "logit_scale": 0.75, "token_weights": True, "num_items_in_batch": torch.tensor(5),
                   "return_stats": True},
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_options(backend, method, reduction, name):
    kw = dict(OPTIONS[name])
    hidden, weight, bias, q = make_case()
    if kw.pop("ce_weight", False):
        kw["ce_weight"] = make_weight(V)
    if kw.pop("token_weights", False):
        kw["token_weights"] = torch.rand(LEAD) + 0.5
    ref, out = check(backend, method, hidden, weight, bias, q, reduction=reduction, **kw)
    if kw.get("return_stats"):
        assert torch.equal(out.predicted_tokens, ref.predicted)
        torch.testing.assert_close(out.token_accuracy.double(), ref.token_accuracy, rtol=0, atol=1e-7)
        torch.testing.assert_close(out.lse.double(), ref.lse, rtol=0, atol=FP32_UNITS * U32 * float(ref.row_mag.max()))
        assert_loss_close(out.z_loss.detach(), type(ref)(**{**ref.__dict__, "loss": ref.z_loss}), torch.float32,
                          name="z_loss")


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("method", METHODS)
def test_target_dtypes_and_frozen(backend, method, q_dtype):
    """The target's dtype is independent of the operands'; a frozen weight / no bias."""
    hidden, weight, bias, q = make_case(q_dtype, bias=False)
    weight.requires_grad_(False)
    logits32 = F.linear(hidden.detach(), weight)
    ref = reference_soft(logits32, q, reduction="sum", upstream=1.0)
    loss = fusedce.linear_cross_entropy(hidden, weight, q, reduction="sum", method=method, backend=backend)
    assert_loss_close(loss.detach(), ref, torch.float32)
    (g_h,) = torch.autograd.grad(loss, hidden)
    w64 = weight.double()
    g = ref.grad.reshape(-1, V)
    bound = (FP32_UNITS * U32 * (ref.grad_err_scale.reshape(-1, 1) + g.abs())) @ w64.abs()
    _check("grad_hidden", g_h.reshape(-1, H), g @ w64, bound)


def test_no_grad_matches_grad_path(backend):
    hidden, weight, bias, q = make_case()
    with torch.no_grad():
        a = fusedce.linear_cross_entropy(hidden, weight, q, bias, reduction="none", backend=backend,
                                         method="tiled")
        b = fusedce.linear_cross_entropy(hidden, weight, q, bias, reduction="none", backend=backend,
                                         method="chunked", chunk_size=CHUNK)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_errors():
    hidden, weight, bias, q = make_case()
    with pytest.raises(TypeError, match=r"target\.detach\(\)"):
        fusedce.linear_cross_entropy(hidden, weight, q.clone().requires_grad_(), backend="torch")
    with pytest.raises(ValueError, match=r"hidden\.shape\[:-1\] \+ \(V,\)"):
        fusedce.linear_cross_entropy(hidden, weight, q[..., :-1], backend="torch")
    with pytest.raises(ValueError, match=r"target\.long\(\)"):
        fusedce.linear_cross_entropy(hidden, weight, q[..., 0], backend="torch")
    with pytest.raises(ValueError, match="use_token_scaling"):
        fusedce.linear_cross_entropy(hidden, weight, q, backend="torch", use_token_scaling=True)
    with pytest.raises(ValueError, match="token_weights"):
        fusedce.linear_cross_entropy(hidden, weight, q, backend="torch", token_weights=torch.ones(3))


@pytest.mark.parametrize("method", METHODS)
def test_module(backend, method):
    """``LinearCrossEntropyLoss`` forwards a probability target as the function does (same values)."""
    hidden, weight, bias, q = make_case()
    module = fusedce.LinearCrossEntropyLoss(reduction="sum", label_smoothing=0.1, method=method, backend=backend)
    got = module(hidden, weight, q, bias)
    want = fusedce.linear_cross_entropy(hidden, weight, q, bias, reduction="sum", label_smoothing=0.1,
                                        method=method, backend=backend)
    assert torch.equal(got, want)
