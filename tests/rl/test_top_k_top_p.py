"""RL: ``top_k`` / ``top_p`` on ``token_log_probs`` / ``linear_token_log_probs`` (the sampler's truncated,
renormalized distribution) against a float64 pairwise reference (``truncated_reference64.py``), both
backends: log-probs, entropy and gradients (logits; hidden, weight, bias), scalar and per-row settings,
rows whose kept set is one class or the whole vocabulary, ties, targets outside the kept set (-inf, zero
gradient), ignored rows, temperature and softcap, several chunks."""
import math

import pytest
import torch

import fusedce
from fusedce.rl import truncated_head
from truncated_reference64 import reference
from tolerances import FP32_MATH_ATOL, GRAD_RTOL

V = 37
SETTINGS = {"plain": (1.0, None), "t0.7": (0.7, None), "t1.3_cap5": (1.3, 5.0)}


def _cases(n: int):
    """name -> (top_k, top_p) as given to the op (numbers or per-row tensors of shape (n,))."""
    k = torch.randint(0, 8, (n,))
    k[0], k[1], k[2] = 1, 0, V + 5              # one class; off; beyond V
    p = torch.rand(n) * 0.9 + 0.05
    p[1], p[2], p[3] = 1.0, 1.0, 1e-4          # row 1: whole vocabulary (both off); row 3: one class by top-p
    return {"top_k": (5, None), "top_p": (None, 0.6), "both": (9, 0.8), "per_row": (k, p),
            "per_row_k_scalar_p": (k, 0.7), "k1": (1, None), "p_tiny": (None, 1e-6)}


def _lists(setting, n):
    k, p = setting
    ks = k.tolist() if isinstance(k, torch.Tensor) else [k or 0] * n
    ps = p.tolist() if isinstance(p, torch.Tensor) else [1.0 if p is None else p] * n
    return ks, ps


def _data(n, ties=False, masked=False):
    x = torch.randn(n, V) * 3
    if ties:   # many exact ties (values on a 0.5 grid) at every boundary
        x = torch.randint(-6, 7, (n, V)).float() * 0.5
    if masked:
        x[4, 3:] = float("-inf")   # a row with few finite classes
    target = torch.randint(0, V, (n,))
    target[::3] = x[::3].argmax(dim=1)   # always kept: some finite rows whatever the kept sets
    target[5] = -100
    target[n - 1] = -100
    return x, target


def _grads(outs, inputs, upstream):
    objective = sum((u * o).sum() for o, u in zip(outs, upstream))
    return torch.autograd.grad(objective, inputs)


def _close(actual, expected, name, rtol=0.0):
    a, e = actual.detach().double(), expected.detach().double()
    assert torch.equal(torch.isinf(a), torch.isinf(e)), f"{name}: -inf rows differ"
    fin = torch.isfinite(e)
    assert not torch.isnan(a).any(), f"{name}: NaN"
    bound = FP32_MATH_ATOL + rtol * (e[fin].abs().max().item() if fin.any() else 0.0)
    err = (a[fin] - e[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("case", ["top_k", "top_p", "both", "per_row", "per_row_k_scalar_p", "k1", "p_tiny"])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_token_log_probs_truncated(backend, case, setting, ties, monkeypatch):
    monkeypatch.setattr(truncated_head, "CHUNK_ELEMENTS", 3 * V)   # several row chunks
    temperature, softcap = SETTINGS[setting]
    n = 12
    x, target = _data(n, ties, masked=softcap is None)
    top_k, top_p = _cases(n)[case]
    logits = x.clone().requires_grad_()
    out = fusedce.token_log_probs(logits, target, temperature=temperature, softcap=softcap, return_entropy=True,
                                  backend=backend, top_k=top_k, top_p=top_p)
    x64 = x.double().requires_grad_()
    ks, ps = _lists((top_k, top_p), n)
    lp64, ent64 = reference(x64, target, ks, ps, temperature, softcap)
    kept = target != -100
    assert torch.isinf(lp64).any() and torch.isfinite(lp64[kept]).any()   # targets outside and inside
    _close(out.log_probs, lp64, "log_probs")
    _close(out.entropy, ent64, "entropy")
    assert out.log_probs[target == -100].eq(0).all() and out.entropy[target == -100].eq(0).all()
    adv, beta = torch.randn(n), torch.randn(n)   # nonzero upstream on -inf and ignored rows too
    (g,) = _grads((out.log_probs, out.entropy), logits, (adv, beta))
    fin = torch.isfinite(lp64)
    lp_ref = torch.where(fin, lp64, 0.0)   # -inf rows: no gradient (the contract)
    (g64,) = _grads((lp_ref, ent64), x64, (adv.double(), beta.double()))
    _close(g, g64, "grad logits", GRAD_RTOL[torch.float32])
    assert g[target == -100].eq(0).all()


def test_outside_kept_set_is_minus_inf_with_zero_gradient(backend):
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0], [4.0, 3.0, 0.0, -1.0]], requires_grad=True)
    target = torch.tensor([2, 1])
    out = fusedce.token_log_probs(logits, target, top_k=2, backend=backend)
    assert out[0] == float("-inf") and math.isfinite(out[1].item())
    (g,) = torch.autograd.grad(out, logits, torch.ones(2))
    assert g[0].eq(0).all()
    assert g[1, 2:].eq(0).all() and not g[1, :2].eq(0).all()   # only the kept classes


def test_tie_rules():
    """top-k: every class tied with the k-th value is kept; top-p: tied classes share their strictly-larger
    mass (kept or dropped together)."""
    logits = torch.tensor([[2.0, 2.0, 2.0, 0.0, -1.0]])
    def lp(target, **kw):
        return fusedce.token_log_probs(logits, torch.tensor([target]), **kw).item()
    third = -math.log(3.0)
    assert lp(2, top_k=1) == pytest.approx(third, abs=1e-6)      # all three tied at the 1st place
    assert lp(3, top_k=1) == float("-inf")
    assert lp(1, top_p=0.01) == pytest.approx(third, abs=1e-6)   # strictly-larger mass 0 for all three
    # class 3's strictly-larger mass is 3 e^2 / (3 e^2 + 1 + e^-1): kept iff top_p exceeds it
    z = torch.tensor([2.0, 2.0, 2.0, 0.0, -1.0], dtype=torch.float64)
    mass = (3 * z[0].exp() / z.exp().sum()).item()
    assert lp(3, top_p=mass - 1e-4) == float("-inf")
    assert math.isfinite(lp(3, top_p=mass + 1e-4))


@pytest.mark.parametrize("case", ["both", "per_row", "p_tiny"])
@pytest.mark.parametrize("setting", ["plain", "t1.3_cap5"])
def test_linear_token_log_probs_truncated(backend, case, setting):
    temperature, softcap = SETTINGS[setting]
    n, hidden_size = 12, 8
    hidden = torch.randn(n, hidden_size)
    weight = torch.randn(V, hidden_size)
    bias = torch.randn(V)
    target = torch.randint(0, V, (n,))
    target[::3] = (hidden @ weight.T + bias)[::3].argmax(dim=1)
    target[5] = -100
    top_k, top_p = _cases(n)[case]
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    out = fusedce.linear_token_log_probs(h, w, target, b, temperature=temperature, softcap=softcap,
                                         return_entropy=True, backend=backend, chunk_size=5, top_k=top_k,
                                         top_p=top_p)
    h64, w64, b64 = (t.double().requires_grad_() for t in (hidden, weight, bias))
    ks, ps = _lists((top_k, top_p), n)
    lp64, ent64 = reference(h64 @ w64.T + b64, target, ks, ps, temperature, softcap)
    _close(out.log_probs, lp64, "log_probs")
    _close(out.entropy, ent64, "entropy")
    adv, beta = torch.randn(n), torch.randn(n)
    grads = _grads((out.log_probs, out.entropy), (h, w, b), (adv, beta))
    grads64 = _grads((torch.where(torch.isfinite(lp64), lp64, 0.0), ent64), (h64, w64, b64),
                     (adv.double(), beta.double()))
    for name, g, g64 in zip(("hidden", "weight", "bias"), grads, grads64):
        _close(g, g64, f"grad {name}", GRAD_RTOL[torch.float32])
    assert grads[0][target == -100].eq(0).all()


def test_linear_bf16_fp32_logits(backend):
    """bf16 head: fp32 logits of the exact products, so within fp32 rounding of float64 of the same values."""
    n = 9
    hidden = torch.randn(n, 8).bfloat16()
    weight = torch.randn(V, 8).bfloat16()
    target = torch.randint(0, V, (n,))
    out = fusedce.linear_token_log_probs(hidden, weight, target, return_entropy=True, backend=backend,
                                         top_k=6, top_p=0.9, temperature=0.8)
    ks, ps = _lists((6, 0.9), n)
    lp64, ent64 = reference(hidden.double() @ weight.double().T, target, ks, ps, 0.8)
    _close(out.log_probs, lp64, "log_probs")
    _close(out.entropy, ent64, "entropy")


def test_off_values_are_the_untruncated_op(backend):
    x, target = _data(6)
    full = fusedce.token_log_probs(x, target, return_entropy=True, backend=backend)
    for k, p in ((0, None), (None, 1.0), (0, 1.0)):
        off = fusedce.token_log_probs(x, target, return_entropy=True, backend=backend, top_k=k, top_p=p)
        assert torch.equal(off.log_probs, full.log_probs) and torch.equal(off.entropy, full.entropy)
    rows = fusedce.token_log_probs(x, target, return_entropy=True, backend=backend,
                                   top_k=torch.zeros(6, dtype=torch.int32), top_p=torch.ones(6))
    torch.testing.assert_close(rows.log_probs, full.log_probs, atol=FP32_MATH_ATOL, rtol=0)
    torch.testing.assert_close(rows.entropy, full.entropy, atol=FP32_MATH_ATOL, rtol=0)


def test_leading_shape_and_per_row_tensors():
    x = torch.randn(2, 3, V)
    target = torch.randint(0, V, (2, 3))
    k = torch.tensor([[1, 2, 3], [0, 5, 9]])
    p = torch.tensor([[0.5, 1.0, 0.9], [0.3, 0.2, 1.0]], dtype=torch.float64)
    out = fusedce.token_log_probs(x, target, top_k=k, top_p=p, return_entropy=True)
    assert out.log_probs.shape == (2, 3) and out.entropy.shape == (2, 3)
    lp64, ent64 = reference(x.reshape(6, V).double(), target.reshape(6), k.reshape(6).tolist(),
                            p.reshape(6).tolist())
    _close(out.log_probs.reshape(6), lp64, "log_probs")
    _close(out.entropy.reshape(6), ent64, "entropy")


def test_empty_all_ignored_and_all_minus_inf_rows():
    """No NaN anywhere: an empty batch, a batch of ignored rows (0, zero gradient, linear form compacted to
    nothing); rows whose logits are all -inf have no distribution: NaN log-prob and entropy (as the untruncated
    op and float64 torch: an entropy bonus must not see a healthy value there), zero gradient."""
    w = torch.randn(V, 3, requires_grad=True)
    for n in (0, 4):
        h = torch.randn(n, 3, requires_grad=True)
        out = fusedce.linear_token_log_probs(h, w, torch.full((n,), -100), top_p=torch.full((n,), 0.5),
                                             return_entropy=True)
        assert out.log_probs.eq(0).all() and out.entropy.eq(0).all()
        gh, gw = torch.autograd.grad(out.log_probs.sum() + out.entropy.sum(), (h, w))
        assert gh.eq(0).all() and gw.eq(0).all()
    x = torch.full((2, V), float("-inf"), requires_grad=True)
    out = fusedce.token_log_probs(x, torch.tensor([1, 2]), top_k=2, top_p=0.5, return_entropy=True)
    assert out.log_probs.isnan().all() and out.entropy.isnan().all()
    full = fusedce.token_log_probs(x.detach(), torch.tensor([1, 2]), return_entropy=True)
    assert full.log_probs.isnan().all() and full.entropy.isnan().all()
    (g,) = torch.autograd.grad((out.log_probs, out.entropy), x, (torch.ones(2), torch.ones(2)))
    assert g.eq(0).all()
