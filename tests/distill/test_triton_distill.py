"""The Triton distillation row ops (``backends/triton/distill.py``: ``distill_rows`` with logits in
memory; ``distill_tiled.py``: ``tiled_distill`` with none) against the float64 oracle
``reference64_distill.py`` (written from the formulas; gradients by float64 autograd), under the Triton
interpreter.

Shapes. Rows: N = 19 tokens, V = 300 classes with the tiles shrunk to 4 rows x 128 columns (a partial
last row tile and column block; rows 8..11 are a whole tile of ignored rows, which the kernel skips; row 1
has 50 -inf teacher logits, row 4 -inf student AND teacher logits over columns 128..255, a whole -inf
block of both streams). Tiled: N = 21, V = 150, H = 24 (student), Ht = 16 (teacher), tiles 8 x 64 x 16
(partial token, class and hidden tiles; rows 8..15 a whole ignored tile), a teacher bias of -inf over
classes 64..127 (a whole -inf class tile). Each test is a few hundred thousand elements.

Bounds (``tolerances.py``'s reasoning): fp32 math on values of magnitude ``M_r`` (1 + log V + the row's
largest |logit| at either temperature) gives ``FP32_UNITS u M_r`` per unit of sensitivity: the loss's
sensitivity is ``1 + hard_label_weight``; a gradient element's is ``grad_factor ((s + t)(1 + |log s| +
|log t| + loss) / T + hard_label_weight p)`` (each probability carries a relative error ``u M_r``, times
the log terms of the reverse KL / JSD gradient); plus the output rounding ``grad_rtol`` of the dtype.
The tiled gradients chain these through ``|W|`` and ``|h|``. bf16 tiled inputs are multiples of 1/4 (and
1/16 for the bias) small enough that every logit is exact in bf16: the kernel's logits (fp32 accumulation,
rounded to bf16) and the oracle's are then the same numbers, so the test sees the kernel's arithmetic
only, not a rounding boundary crossed by fp32 accumulation.
"""
import math

import pytest
import torch

from fusedce.backends.triton import distill as D
from fusedce.backends.triton import distill_tiled as DT
from fusedce.backends.triton import tuning
from reference64_distill import distill_rows64
from tolerances import FP32_UNITS, TOLERANCES, U32, _check

IGNORE = -100
N, V = 19, 300
TN, TV, TH, THT = 21, 150, 24, 16
OPTION_SETS = {   # (hard_label_weight, student_softcap, teacher_softcap)
    "plain": (0.0, None, None),
    "hard+student_cap": (0.5, 20.0, None),
    "hard+teacher_cap": (0.7, None, 5.0),
}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tuning, "distill_rows_config", lambda n_cols: {
        "BLOCK_N": 4, "BLOCK_V": 128, "num_warps": 4, "maxnreg": 128})
    monkeypatch.setattr(tuning, "distill_tiled_config", lambda kernel, elem_size=2: {
        "BLOCK_N": 8, "BLOCK_V": 64, "BLOCK_H": 16, "num_warps": 4, "num_stages": 2, "maxnreg": 255})


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every output the kernels write whole starts as NaN: an element left unwritten fails."""
    rows_buffers, new_rows = D._rows_buffers, D._new_rows
    monkeypatch.setattr(D, "_rows_buffers", lambda *a: tuple(t.fill_(float("nan")) for t in rows_buffers(*a)))
    for module in (D, DT):
        monkeypatch.setattr(module, "_new_rows", lambda *a: new_rows(*a).fill_(float("nan")))


def _row_inputs(student_dtype=torch.float32, teacher_dtype=torch.float32, n=N, v=V):
    zs = torch.randn(n, v) * 3
    zt = torch.randn(n, v) * 3
    zt[1, :50] = float("-inf")
    zs[4, 128:256] = float("-inf")
    zt[4, 128:256] = float("-inf")
    target = torch.randint(0, v, (n,))
    target[4] = 3                    # a target the -inf block does not hold
    target[8:12] = IGNORE            # a whole tile of ignored rows
    target[15] = IGNORE
    target[6] = v - 1                # the last class
    grad_factor = torch.rand(n) * 2 - 0.5   # varied, some negative
    return zs.to(student_dtype), zt.to(teacher_dtype), target, grad_factor


def _kw(beta, temperature, opts):
    hw, sc, tc = OPTION_SETS[opts]
    return dict(beta=beta, temperature=temperature, hard_label_weight=hw, student_softcap=sc, teacher_softcap=tc)


def _oracle(zs, zt, target, grad_factor, kw):
    """float64 ``(loss_rows, grad, loss bound, grad bound)`` at the exact input values."""
    x = zs.double().requires_grad_()
    loss = distill_rows64(x, zt.double(), target, ignore_index=IGNORE, **kw)
    (torch.where(torch.isfinite(loss), loss, 0.0) * grad_factor.double()).sum().backward()
    grad = x.grad
    for r in torch.nonzero(torch.isfinite(loss) & grad.isnan().any(1)).flatten().tolist():
        # A class where both logits are -inf (s = t = m = 0) makes the oracle's autograd NaN (d log m at
        # m = 0) although it takes no part in the loss: the row's gradient is the oracle's on the other
        # classes, and exactly 0 on these.
        keep = torch.isfinite(zs[r]) | torch.isfinite(zt[r])
        xr = zs[r, keep].double()[None].requires_grad_()
        tr = None if target is None else keep[:target[r]].sum()[None]
        distill_rows64(xr, zt[r, keep].double()[None], tr, ignore_index=IGNORE, **kw).sum().backward()
        grad[r] = 0.0
        grad[r, keep] = xr.grad[0] * grad_factor[r].double()
    with torch.no_grad():
        cap = lambda z, c: z if c is None else c * torch.tanh(z / c)   # noqa: E731
        c = cap(zs.double(), kw["student_softcap"])
        w = cap(zt.double(), kw["teacher_softcap"]) / kw["temperature"]
        u = c / kw["temperature"]
        ls, lt, lc = u.log_softmax(1), w.log_softmax(1), c.log_softmax(1)
        fin = lambda a: torch.where(torch.isfinite(a), a, 0.0)   # noqa: E731
        mag = 1 + math.log(zs.shape[1]) + torch.stack([fin(u).abs(), fin(w).abs(), fin(c).abs()]).amax((0, 2))
        hw = abs(kw["hard_label_weight"])
        loss_bound = FP32_UNITS * U32 * mag * (1 + hw)
        sens = ((ls.exp() + lt.exp()) * (1 + fin(ls).abs() + fin(lt).abs() + fin(loss)[:, None].abs())
                / kw["temperature"] + hw * lc.exp())
        grad_bound = FP32_UNITS * U32 * mag[:, None] * grad_factor.double().abs()[:, None] * sens
    return loss.detach(), grad, loss_bound, grad_bound


def _assert_rows(loss, grad, zs, zt, target, grad_factor, kw, name=""):
    ref_loss, ref_grad, loss_bound, grad_bound = _oracle(zs, zt, target, grad_factor, kw)
    finite = torch.isfinite(ref_loss)
    assert loss.dtype == torch.float32
    assert torch.equal(loss[~finite], ref_loss[~finite].float()), name   # +inf rows (reverse KL, t = 0 < s)
    _check(f"{name} loss", loss[finite], ref_loss[finite], TOLERANCES[torch.float32].loss_rtol * ref_loss[finite].abs()
           + loss_bound[finite])
    if grad is None:
        return
    tol = TOLERANCES[zs.dtype]
    assert grad.dtype == zs.dtype and grad.shape == zs.shape
    bound = tol.grad_rtol * ref_grad.abs() + grad_bound + tol.grad_atol
    _check(f"{name} grad", grad[finite], ref_grad[finite], bound[finite])
    ignored = target == IGNORE
    assert bool((grad[ignored] == 0).all()) and bool((loss[ignored] == 0).all()), name


def _rows(zs, zt, target, grad_factor, kw):
    return D.distill_rows(zs, zt, target, grad_factor, ignore_index=IGNORE, **kw)


@pytest.mark.parametrize("opts", list(OPTION_SETS))
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_rows_match_oracle(beta, temperature, opts):
    zs, zt, target, gf = _row_inputs()
    kw = _kw(beta, temperature, opts)
    loss, grad = _rows(zs, zt, target, gf, kw)
    _assert_rows(loss, grad, zs, zt, target, gf, kw)
    if beta == 1.0 and kw["teacher_softcap"] is None:   # row 1: teacher mass 0 where the student's is not
        assert loss[1] == float("inf")
    loss_only, none = _rows(zs, zt, target, None, kw)
    assert none is None
    assert torch.equal(loss_only, loss)   # the loss passes do not depend on the gradient pass


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                    (torch.float16, torch.bfloat16)])
def test_rows_low_precision_inputs(dtypes):
    """Logits of either dtype upcast after loading (exact), fp32 math, the gradient in the student's dtype."""
    zs, zt, target, gf = _row_inputs(*dtypes)
    kw = _kw(0.3, 2.0, "hard+student_cap")
    loss, grad = _rows(zs, zt, target, gf, kw)
    _assert_rows(loss, grad, zs, zt, target, gf, kw, name=str(dtypes))


def test_rows_strided_inputs_no_target_and_broadcast_factor():
    """Row strides wider than V (views into larger buffers), a stride-0 grad_factor (the upstream of a
    mean), no target (no row ignored, no hard label); the inputs are not written."""
    big_s, big_t = torch.randn(N, V + 37) * 2, torch.randn(N, V + 5) * 2
    zs, zt = big_s[:, 3:V + 3], big_t[:, :V]
    before = (big_s.clone(), big_t.clone())
    gf = torch.tensor(0.37).expand(N)
    kw = _kw(0.0, 1.5, "plain")
    loss, grad = _rows(zs, zt, None, gf, kw)
    _assert_rows(loss, grad, zs, zt, None, gf, kw)
    assert torch.equal(before[0], big_s) and torch.equal(before[1], big_t)


def test_rows_empty_and_all_ignored():
    kw = _kw(0.5, 1.0, "hard+teacher_cap")
    loss, grad = _rows(torch.randn(0, V), torch.randn(0, V), torch.zeros(0, dtype=torch.long), torch.ones(0), kw)
    assert loss.shape == (0,) and grad.shape == (0, V)
    zs, zt, _, gf = _row_inputs()
    loss, grad = _rows(zs, zt, torch.full((N,), IGNORE), gf, kw)
    assert torch.equal(loss, torch.zeros(N)) and torch.equal(grad, torch.zeros(N, V))


def test_rows_bad_inputs():
    zs, zt, target, gf = _row_inputs()
    kw = _kw(0.0, 1.0, "plain")
    with pytest.raises(ValueError, match="N, V"):
        _rows(zs, zt[:, :-1], target, gf, kw)
    with pytest.raises(ValueError, match="target"):
        _rows(zs, zt, target[:-1], gf, kw)
    with pytest.raises(ValueError, match="grad_factor"):
        _rows(zs, zt, target, gf[:-1], kw)
    with pytest.raises(ValueError, match="beta"):
        _rows(zs, zt, target, gf, dict(kw, beta=1.5))
    with pytest.raises(ValueError, match="temperature"):
        _rows(zs, zt, target, gf, dict(kw, temperature=0.0))
    with pytest.raises(ValueError, match="needs a target"):
        _rows(zs, zt, None, gf, dict(kw, hard_label_weight=1.0))
    with pytest.raises(ValueError, match="softcap"):
        _rows(zs, zt, target, gf, dict(kw, student_softcap=-1.0))


def test_rows_agree_with_torch_backend():
    """The Triton and torch row ops (same signature) on the same inputs, every beta (each against the
    oracle's bound; here against each other at the sum of the two bounds)."""
    torch_rows = pytest.importorskip("fusedce.backends.pytorch.distill").distill_rows
    zs, zt, target, gf = _row_inputs()
    for beta in (0.0, 0.3, 1.0):
        kw = _kw(beta, 2.0, "hard+student_cap")
        loss, grad = _rows(zs, zt, target, gf, kw)
        loss_t, grad_t = torch_rows(zs, zt, target, gf, ignore_index=IGNORE, **kw)
        _ref_loss, _ref_grad, loss_bound, grad_bound = _oracle(zs, zt, target, gf, kw)
        _check(f"beta={beta} loss", loss, loss_t, 2 * loss_bound)
        _check(f"beta={beta} grad", grad, grad_t, 2 * grad_bound)


# ---------------------------------------------------------------- tiled (no logits)

def _heads(dtype, teacher_dtype=None, bias=True, teacher_mask=True):
    teacher_dtype = teacher_dtype or dtype
    if dtype == torch.float32:
        hs, ws = torch.randn(TN, TH), torch.randn(TV, TH) * 0.4
        ht, wt = torch.randn(TN, THT), torch.randn(TV, THT) * 0.6
        bs, bt = torch.randn(TV), torch.randn(TV)
    else:   # exact logits in bf16 / fp16 (see the module docstring)
        q = lambda *s: torch.randint(-2, 3, s) / 4   # noqa: E731
        hs, ws, ht, wt = q(TN, TH), q(TV, TH), q(TN, THT), q(TV, THT)
        bs, bt = torch.randint(-16, 17, (TV,)) / 16, torch.randint(-16, 17, (TV,)) / 16
    if teacher_mask:   # (a reverse KL is +inf where t = 0 < s: kept out of that case)
        bt[64:128] = float("-inf")
    target = torch.randint(0, TV, (TN,))
    target[8:16] = IGNORE
    target[3] = IGNORE
    target[5] = TV - 1
    gf = torch.rand(TN) * 2 - 0.5
    s = (hs.to(dtype), ws.to(dtype), bs.to(dtype) if bias else None)
    t = (ht.to(teacher_dtype), wt.to(teacher_dtype), bt.to(teacher_dtype) if bias else None)
    return s, t, target, gf


def _logits(h, w, b):
    z = h.double() @ w.double().T + (0.0 if b is None else b.double())
    return z.to(h.dtype).double()   # rounded once to the head's dtype (F.linear's logits)


def _tiled(s, t, target, gf, kw, deterministic):
    return DT.tiled_distill(*s, *t, target, gf, ignore_index=IGNORE, deterministic=deterministic, **kw)


def _assert_tiled(out, s, t, target, gf, kw):
    loss, gh, gw, gb = out
    zs, zt = _logits(*s), _logits(*t)
    ref_loss, g, loss_bound, g_bound = _oracle(zs, zt, target, gf, kw)
    _check("loss", loss, ref_loss, TOLERANCES[torch.float32].loss_rtol * ref_loss.abs() + loss_bound)
    tol = TOLERANCES[s[0].dtype]
    g_bound = g_bound + tol.grad_rtol * g.abs()          # dx rounded to the student's dtype
    h, w = s[0].double(), s[1].double()
    acc = FP32_UNITS * U32                               # fp32 accumulation of the products
    _check("grad_hidden", gh.double(), g @ w, g_bound @ w.abs() + (acc + tol.grad_rtol) * (g.abs() @ w.abs()))
    _check("grad_weight", gw, g.T @ h, g_bound.T @ h.abs() + acc * (g.abs().T @ h.abs()))
    assert gh.dtype == s[0].dtype and gw.dtype == torch.float32
    if s[2] is None:
        assert gb is None
    else:
        assert gb.dtype == torch.float32
        _check("grad_bias", gb, g.sum(0), g_bound.sum(0) + acc * g.abs().sum(0))
    assert bool((gh[target == IGNORE] == 0).all())


@pytest.mark.parametrize("opts", list(OPTION_SETS))
@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (0.3, 2.0), (1.0, 1.5), (0.0, 2.0), (0.6, 1.0)])
def test_tiled_match_oracle(beta, temperature, opts):
    kw = _kw(beta, temperature, opts)
    s, t, target, gf = _heads(torch.float32, teacher_mask=beta < 1.0 or kw["teacher_softcap"] is not None)
    deterministic = opts != "plain"
    _assert_tiled(_tiled(s, t, target, gf, kw, deterministic), s, t, target, gf, kw)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                    (torch.float16, torch.float16)])
def test_tiled_low_precision(dtypes):
    s, t, target, gf = _heads(*dtypes)
    kw = _kw(0.3, 2.0, "hard+student_cap")
    for deterministic in (False, True):
        _assert_tiled(_tiled(s, t, target, gf, kw, deterministic), s, t, target, gf, kw)


def test_tiled_deterministic_rerun_is_bitwise_and_matches_atomic():
    """``deterministic=True`` twice: bitwise equal (the interpreter runs programs in order, so this checks
    the owned kernels' own order, not GPU scheduling); the atomic path agrees to fp32 rounding."""
    s, t, target, gf = _heads(torch.float32)
    kw = _kw(1.0, 2.0, "hard+teacher_cap")
    a = _tiled(s, t, target, gf, kw, True)
    b = _tiled(s, t, target, gf, kw, True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = _tiled(s, t, target, gf, kw, False)
    assert torch.equal(a[0], c[0])   # same statistics kernels
    for x, y in zip(a[1:], c[1:]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_tiled_no_bias_no_target_no_grad():
    s, t, _target, gf = _heads(torch.float32, bias=False)
    kw = _kw(0.0, 1.0, "plain")
    out = _tiled(s, t, None, gf, kw, False)
    _assert_tiled(out, s, t, None, gf, kw)
    loss, *grads = _tiled(s, t, None, None, kw, False)
    assert grads == [None, None, None]
    assert torch.equal(loss, out[0])


def test_tiled_empty_and_all_ignored():
    s, t, _target, gf = _heads(torch.float32)
    kw = _kw(0.3, 1.0, "hard+student_cap")
    for det in (False, True):
        loss, gh, gw, gb = _tiled(s, t, torch.full((TN,), IGNORE), gf, kw, det)
        assert torch.equal(loss, torch.zeros(TN)) and torch.equal(gh, torch.zeros(TN, TH))
        assert torch.equal(gw, torch.zeros(TV, TH)) and torch.equal(gb, torch.zeros(TV))
        empty = lambda x: x[:0]   # noqa: E731
        loss, gh, gw, gb = _tiled((empty(s[0]), s[1], s[2]), (empty(t[0]), t[1], t[2]), target := torch.zeros(
            0, dtype=torch.long), empty(gf), kw, det)
        assert loss.shape == (0,) and gh.shape == (0, TH) and torch.equal(gw, torch.zeros(TV, TH))
        assert target.numel() == 0


def test_tiled_agrees_with_torch_backend():
    """The Triton and torch tiled ops (same signature) on the same inputs: loss at the sum of the oracle
    bounds, gradients at the fp32 accumulation bound of each (the same dx, summed in different orders)."""
    torch_tiled = pytest.importorskip("fusedce.backends.pytorch.distill_tiled").tiled_distill
    s, t, target, gf = _heads(torch.float32)
    for beta in (0.0, 0.3, 1.0):
        kw = _kw(beta, 2.0, "hard+teacher_cap")
        a = _tiled(s, t, target, gf, kw, True)
        b = torch_tiled(*s, *t, target, gf, ignore_index=IGNORE, deterministic=True, **kw)
        _ref, g, loss_bound, g_bound = _oracle(_logits(*s), _logits(*t), target, gf, kw)
        _check(f"beta={beta} loss", a[0], b[0], 2 * loss_bound)
        w, h = s[1].double().abs(), s[0].double().abs()
        _check(f"beta={beta} grad_hidden", a[1], b[1], 2 * (g_bound + FP32_UNITS * U32 * g.abs()) @ w)
        _check(f"beta={beta} grad_weight", a[2], b[2], 2 * (g_bound + FP32_UNITS * U32 * g.abs()).T @ h)
        _check(f"beta={beta} grad_bias", a[3], b[3], 2 * (g_bound + FP32_UNITS * U32 * g.abs()).sum(0))


def test_tiled_bad_inputs():
    s, t, target, gf = _heads(torch.float32)
    kw = _kw(0.0, 1.0, "plain")
    with pytest.raises(ValueError, match="teacher"):
        _tiled(s, (t[0], t[1][:-1], t[2]), target, gf, kw, False)      # V differs
    with pytest.raises(ValueError, match="dtype"):
        _tiled((s[0], s[1].double(), s[2]), t, target, gf, kw, False)
    with pytest.raises(ValueError, match="beta"):
        _tiled(s, t, target, gf, dict(kw, beta=-0.1), False)


def test_custom_ops_trace_under_torch_compile():
    """Both ops are torch custom ops with fakes: ``torch.compile(fullgraph=True)`` traces them (no graph
    break) and gives the eager numbers."""
    zs, zt, target, gf = _row_inputs(n=16)
    kw = _kw(0.3, 2.0, "hard+student_cap")
    rows = torch.compile(lambda a, b, c, d: _rows(a, b, c, d, kw), fullgraph=True)
    for x, y in zip(rows(zs, zt, target, gf), _rows(zs, zt, target, gf, kw)):
        assert torch.equal(x, y)
    s, t, target, gf = _heads(torch.float32)
    tiled = torch.compile(lambda *a: _tiled(a[:3], a[3:6], a[6], a[7], kw, True), fullgraph=True)
    for x, y in zip(tiled(*s, *t, target, gf), _tiled(s, t, target, gf, kw, True)):
        assert torch.equal(x, y)
