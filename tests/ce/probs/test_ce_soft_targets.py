"""Probability ("soft") targets in ``fusedce.cross_entropy`` (the contract's last section): a float target
of ``logits.shape`` with ``F.cross_entropy``'s semantics, every option and reduction, both backends of this
machine (Triton under the interpreter), against the float64 oracle ``reference64_soft`` (itself checked
against ``F.cross_entropy`` in float64 below) with the tolerance table (tolerances.py).

Shapes: (2, 3) = 6 rows x V = 75 classes (odd: a partial last block). The Triton launches are run with
``MAX_BLOCK_V`` = 32 (``tuning.py``), so each row spans 3 blocks: the forward's online re-basing of its
sums and the backward's 2-D grid are both exercised (at the real 4096 a row this small is one block);
one case keeps the real block size. Row maxima are planted in different blocks. Targets: random
distributions (softmax of randn * 2), one row one-hot (the hard label as a distribution), one row with
zeros. Allocations are poisoned (``inputs.poisoned_allocations``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusedce
from fusedce.ce import checks
from inputs import DTYPE_IDS, DTYPES, make_weight, poisoned_allocations
from reference64_soft import reference_soft
from tolerances import assert_grad_close, assert_loss_close, assert_lse_close

LEAD, V = (2, 3), 75
REDUCTIONS = ("mean", "sum", "none")


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """Triton: 32-class blocks, so that a row of 75 spans three (the online re-basing, the 2-D grid)."""
    from fusedce.backends.triton import tuning
    monkeypatch.setattr(tuning, "MAX_BLOCK_V", 32)


def make_inputs(lead=LEAD, n_classes=V, dtype=torch.float32, q_dtype=torch.float32, scale=2.0):
    x = torch.randn(*lead, n_classes) * scale
    flat = x.view(-1, n_classes)
    for r in range(flat.shape[0]):   # plant each row's max in a different block (first, middle, last)
        flat[r, (r * 37) % n_classes] = scale * 4.0
    q = torch.softmax(torch.randn(*lead, n_classes) * 2.0, dim=-1)
    qf = q.view(-1, n_classes)
    if qf.shape[0] >= 2:
        qf[0] = F.one_hot(torch.tensor(n_classes - 1), n_classes).float()   # a hard label as a distribution
        qf[1, ::3] = 0.0                                                    # zeros (not renormalized)
    return x.to(dtype).requires_grad_(), q.to(q_dtype)


def upstream_for(reduction):
    return torch.randn(LEAD) if reduction == "none" else 3.7


def run(logits, q, weight=None, *, backend, upstream, token_weights=None, **kw):
    """Forward + backward through the public function, allocations poisoned; ``(out, grad)``. With
    ``inplace_backward`` the op gets a clone (its storage receives the gradient, never the leaf's)."""
    with poisoned_allocations():
        given = logits.clone() if kw.get("inplace_backward") else logits
        out = fusedce.cross_entropy(given, q, weight, backend=backend, token_weights=token_weights, **kw)
        loss = out.loss if isinstance(out, fusedce.CrossEntropyOutput) else out
        up = upstream if isinstance(upstream, torch.Tensor) else torch.full_like(loss, float(upstream))
        (grad,) = torch.autograd.grad(loss, logits, up)
    return out, grad


def check(backend, logits, q, weight=None, *, reduction="mean", upstream=None, **kw):
    ref_kw = {k: v for k, v in kw.items() if k not in ("inplace_backward", "return_stats", "ignore_index")}
    upstream = upstream_for(reduction) if upstream is None else upstream
    ref = reference_soft(logits, q, weight, reduction=reduction, upstream=upstream, **ref_kw)
    q_before = q.clone()
    out, grad = run(logits, q, weight, backend=backend, reduction=reduction, upstream=upstream, **kw)
    loss = out.loss if isinstance(out, fusedce.CrossEntropyOutput) else out
    assert_loss_close(loss.detach(), ref, logits.dtype)
    assert_grad_close(grad, ref, logits.dtype)
    assert torch.equal(q, q_before), "the caller's target was modified"
    return ref, out


def test_reference_is_torch():
    """The oracle is F.cross_entropy with probability targets (float64; class weights, smoothing)."""
    x, q = make_inputs()
    w = make_weight(V).double()
    for reduction in REDUCTIONS:
        for eps in (0.0, 0.3):
            ref = reference_soft(x, q, w, reduction=reduction, label_smoothing=eps, upstream=1.0)
            x64 = x.detach().double().reshape(-1, V).requires_grad_()
            torch_loss = F.cross_entropy(x64, q.double().reshape(-1, V), w, reduction=reduction, label_smoothing=eps)
            (torch_grad,) = torch.autograd.grad(torch_loss, x64, torch.ones_like(torch_loss))
            assert torch.allclose(ref.loss.reshape(-1), torch_loss.detach().reshape(-1), rtol=1e-12, atol=0)
            assert torch.allclose(ref.grad.reshape(-1, V), torch_grad, rtol=1e-10, atol=1e-15)


OPTIONS = {
    "plain": {},
    "smoothing+weight": {"label_smoothing": 0.1, "weight": True},
    "zloss+softcap+scale": {"lse_square_scale": 1e-2, "softcap": 5.0, "logit_scale": 1.5},
    "token_weights+num_items": {"token_weights": True, "lse_square_scale": 1e-2, "num_items_in_batch": 11},
    "everything": {"weight": True, "label_smoothing": 0.2, "lse_square_scale": 1e-2, "softcap": 8.0,
                   "logit_scale": 0.75, "token_weights": True, "num_items_in_batch": torch.tensor(5),
                   "inplace_backward": True, "return_stats": True, "ignore_index": -1},   # negative: unused (torch)
}


def _options(name, lead=LEAD):
    kw = dict(OPTIONS[name])
    weight = make_weight(V) if kw.pop("weight", False) else None
    if kw.pop("token_weights", False):
        kw["token_weights"] = torch.rand(lead) * 4.0 - 1.0   # in [-1, 3): negative weights allowed
    return weight, kw


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_options(backend, name, reduction):
    x, q = make_inputs()
    weight, kw = _options(name)
    check(backend, x, q, weight, reduction=reduction, **kw)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["q32", "q-bf16", "q-fp16", "q64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_dtypes(backend, dtype, q_dtype):
    """Logits and target dtypes independent of each other; the math is fp32 on their exact values."""
    x, q = make_inputs(dtype=dtype, q_dtype=q_dtype)
    check(backend, x, q, make_weight(V), label_smoothing=0.1, lse_square_scale=1e-3, softcap=10.0)


def test_real_block_size(backend, monkeypatch):
    """V = 300 at the real block size (one block per row), strided inputs: logits rows of stride 320 and a
    target that is a column slice of a wider tensor (row stride 310) plus a transposed one (copied)."""
    from fusedce.backends.triton import tuning
    monkeypatch.setattr(tuning, "MAX_BLOCK_V", 4096)
    base = torch.randn(5, 320) * 3.0
    x = base[:, :300].requires_grad_(False)
    leaf = x.clone().requires_grad_()
    q_wide = torch.softmax(torch.randn(5, 310), -1)
    q = q_wide[:, :300]
    check(backend, leaf[None], q[None], reduction="sum", label_smoothing=0.05)
    q_t = torch.softmax(torch.randn(300, 5), 0).t()   # last-dim stride 5
    check(backend, leaf, q_t, reduction="none", upstream=torch.randn(5))


def test_stats(backend):
    """lse, z_loss (times token weights), predicted = argmax of the logits, token accuracy against the
    argmax of the target; every row counts (no ignore_index)."""
    x, q = make_inputs()
    q.view(-1, V)[2] = F.one_hot(x.detach().view(-1, V)[2].argmax(), V).float()   # at least one hit
    tw = torch.rand(LEAD) + 0.5
    for reduction in REDUCTIONS:
        ref, out = check(backend, x, q, reduction=reduction, lse_square_scale=1e-2, token_weights=tw,
                         return_stats=True)
        assert_lse_close(out.lse, ref, x.dtype)
        assert torch.allclose(out.z_loss.double(), ref.z_loss, rtol=1e-5, atol=1e-7)
        assert torch.equal(out.predicted_tokens, ref.predicted)
        assert torch.equal(out.token_accuracy, ref.token_accuracy.float())
        assert out.z_loss.grad_fn is None and out.lse.grad_fn is None


def test_empty_and_zero_denominator(backend):
    for lead in ((0,), (2, 0)):
        x = torch.randn(*lead, V).requires_grad_()
        q = torch.rand(*lead, V)
        for reduction in REDUCTIONS:
            out = fusedce.cross_entropy(x, q, reduction=reduction, lse_square_scale=1e-2, backend=backend)
            assert out.dtype == torch.float32
            assert out.shape == (lead if reduction == "none" else ())
            if reduction != "none":
                assert float(out.detach()) == 0.0
            (g,) = torch.autograd.grad(out.sum(), x)
            assert g.shape == x.shape
    x, q = make_inputs()
    out, grad = run(x, q, backend=backend, upstream=1.0, num_items_in_batch=0, lse_square_scale=1e-2)
    assert float(out.detach()) == 0.0 and bool((grad == 0).all())


def test_single_class(backend):
    """V = 1: softmax is 1, the loss is 0 (z-loss only) and so is the gradient without z-loss."""
    x = torch.randn(4, 1).requires_grad_()
    q = torch.rand(4, 1)
    check(backend, x, q, reduction="none", upstream=torch.randn(4))
    out, grad = run(x, q, backend=backend, upstream=1.0, reduction="sum")
    assert float(out.detach()) == 0.0 and bool((grad == 0).all())


def test_neg_inf_logits(backend):
    """-inf logits (a masked vocabulary) where the target is 0: a finite loss and gradient, no NaN (torch's
    composition gives NaN here); with and without softcap."""
    x, q = make_inputs()
    with torch.no_grad():
        x.view(-1, V)[:, 40:60] = float("-inf")
    q = q.clone()
    q.view(-1, V)[:, 40:60] = 0.0
    for kw in ({}, {"softcap": 5.0, "label_smoothing": 0.0}):
        ref, out = check(backend, x, q, reduction="none", **kw)
        assert bool(torch.isfinite(out).all())
    _, grad = run(x, q, backend=backend, upstream=1.0)
    assert bool(torch.isfinite(grad).all()) and bool((grad.view(-1, V)[:, 40:60] == 0).all())


def test_loss_scaling_fp16(backend, monkeypatch):
    """fp16 logits, upstream 2^16 (GradScaler's initial scale) on a mean over D = 2^16 items: the gradient
    is as accurate as stock's (F.cross_entropy on the fp32 upcast, same upstream), by the rule of
    test_loss_scaling.py (relative Frobenius error <= 2 x stock's + 2^-20)."""
    from fusedce.backends.triton import tuning
    monkeypatch.setattr(tuning, "MAX_BLOCK_V", 4096)   # one block per row: this case is about precision
    n_classes, d, s = 512, 2.0 ** 16, 2.0 ** 16
    base = (torch.randn(32, n_classes) * 2.0).half()
    q = torch.softmax(torch.randn(32, n_classes) * 3.0, -1)
    x64 = base.double().requires_grad_()
    ref_loss = F.cross_entropy(x64, q.double(), reduction="sum") / d
    (ref,) = torch.autograd.grad(ref_loss, x64, torch.tensor(s, dtype=torch.float64))
    leaf = base.clone().requires_grad_()
    out, grad = run(leaf, q, backend=backend, upstream=s, num_items_in_batch=int(d))
    stock_leaf = base.clone().requires_grad_()
    stock = F.cross_entropy(stock_leaf.float(), q, reduction="sum") / d
    (stock_grad,) = torch.autograd.grad(stock, stock_leaf, torch.tensor(s))
    err = float((grad.double() - ref).norm() / ref.norm())
    stock_err = float((stock_grad.double() - ref).norm() / ref.norm())
    assert grad.dtype == torch.float16 and bool(torch.isfinite(grad).all())
    assert err <= 2.0 * stock_err + 2.0 ** -20, f"fused {err:.3e} stock {stock_err:.3e}"


def test_module(backend):
    x, q = make_inputs()
    w = make_weight(V)
    module = fusedce.CrossEntropyLoss(w, label_smoothing=0.1, lse_square_scale=1e-2, backend=backend)
    ref = reference_soft(x, q, w, label_smoothing=0.1, lse_square_scale=1e-2, num_items_in_batch=4, upstream=1.0)
    loss = module(x, q, 4)
    (grad,) = torch.autograd.grad(loss, x)
    assert_loss_close(loss.detach(), ref, x.dtype)
    assert_grad_close(grad, ref, x.dtype)


def test_compile_torch_backend():
    """torch.compile(fullgraph=True) through the torch backend's custom ops: eager's numbers."""
    torch._dynamo.reset()
    x, q = make_inputs()
    w = make_weight(V)
    kw = dict(label_smoothing=0.1, lse_square_scale=1e-2, softcap=6.0, backend="torch")

    def step(logits, target):
        return fusedce.cross_entropy(logits, target, w, **kw)

    eager = step(x, q)
    (g_eager,) = torch.autograd.grad(eager, x)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x, q)
    (g_compiled,) = torch.autograd.grad(compiled, x)
    torch._dynamo.reset()
    assert torch.equal(compiled.detach(), eager.detach()) and torch.equal(g_compiled, g_eager)


def test_errors(backend):
    x, q = make_inputs()
    with pytest.raises(ValueError, match=r"logits' shape \(2, 3, 75\).*got \(2, 3, 74\)"):
        fusedce.cross_entropy(x, q[..., :74], backend=backend)
    with pytest.raises(ValueError, match=r"got \(2, 3\).*class indices stored as floats.*target.long\(\)"):
        fusedce.cross_entropy(x, torch.zeros(LEAD), backend=backend)
    with pytest.raises(TypeError, match="int64 or int32 class indices, or a float32"):
        fusedce.cross_entropy(x, q > 0.5, backend=backend)
    with pytest.raises(TypeError, match="int64 or int32 class indices"):
        fusedce.cross_entropy(x, torch.zeros(LEAD, dtype=torch.uint8), backend=backend)
    with pytest.raises(TypeError, match="must be float32, bfloat16, float16 or float64"):
        fusedce.cross_entropy(x, q.to(torch.float8_e4m3fn), backend=backend)
    with pytest.raises(TypeError, match="target.detach"):
        fusedce.cross_entropy(x, q.clone().requires_grad_(), backend=backend)
    with pytest.raises(ValueError, match="use_token_scaling"):
        fusedce.cross_entropy(x, q, use_token_scaling=True, backend=backend)
    with pytest.raises(ValueError, match=r"token_weights shape \(2,\) .*\(2, 3\)"):
        fusedce.cross_entropy(x, q, token_weights=torch.ones(2), backend=backend)
    with pytest.raises(ValueError, match=r"weight must have shape \(75,\)"):
        fusedce.cross_entropy(x, q, torch.ones(74), backend=backend)


def test_cute_refuses():
    """The CuTe DSL backend has no probability-target kernels: a NotImplementedError naming it (on CPU
    tensors backend="cute" is refused earlier, by backend selection, with its RuntimeError)."""
    from fusedce.backends import cute
    with pytest.raises(NotImplementedError, match="probability.*'cute'"):
        checks.probs_backend(cute, "cute")


def test_integer_targets_unchanged(backend):
    """Integer targets still take the class-index path (against its own float64 reference), and a one-hot
    probability target gives the per-row loss of its class index, to fp32 rounding."""
    from inputs import check_against_reference, make_logits, make_target
    x = make_logits((6, V))
    t = make_target((6,), V, ignore_every=3)
    check_against_reference(x, t, backend=backend, label_smoothing=0.1)
    one_hot = F.one_hot(t.clamp_min(0), V).float()
    soft = fusedce.cross_entropy(x, one_hot, backend=backend, reduction="none")
    hard = fusedce.cross_entropy(x, t.clamp_min(0), backend=backend, reduction="none")
    assert torch.allclose(soft, hard, rtol=2.0 ** -20, atol=1e-6)
