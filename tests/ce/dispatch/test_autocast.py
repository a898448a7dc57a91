"""Every public op under ``torch.autocast`` behaves as the stock composition under the same autocast.

Stock compositions, run under the same ``torch.autocast("cpu", dtype)``:
- ``cross_entropy`` / ``CrossEntropyLoss``: ``F.cross_entropy(logits, t, weight, ...)`` (on autocast's
  fp32 list: fp32 math on the logits whatever their dtype); fusedce runs with autocast disabled inside,
  so that no internal matmul (the smoothing term ``z @ weight``) is downcast.
- ``linear_cross_entropy`` / ``LinearCrossEntropyLoss``: ``F.cross_entropy(F.linear(h, w, b).float(), t,
  ...)``: the matmul in the autocast dtype (autocast casts h, w, b), the loss in fp32; gradients reach
  the leaves through the casts, in the leaves' own dtypes.
Each op with each reduction ("none" with a random per-token upstream gradient), both backends (the
Triton kernels under the interpreter), autocast dtypes bf16 and fp16, class weights and label
smoothing (so the smoothing matmul runs), one ignored row. Inputs: fp32 leaves, and a mixed case
(linear: hidden already in the autocast dtype with an fp32 head, which stock ``F.linear`` accepts under
autocast; cross-entropy: low-precision logits made by ``F.linear`` under autocast, leaves h, w, b fp32).

Tolerances (why fusedce and stock may differ at all, and by how much). Both paths start from the same
logits: the same ``F.linear`` on the same cast values (fusedce on the non-ignored rows only; each
element is the same H-term dot product, rounded once to the autocast dtype), or the same given logits.
From there both compute the loss in fp32; they differ only in the order of fp32 operations:
- loss: per row, every term is at most ``w_max (1 + eps) M_r`` in magnitude (``M_r = 1 + |lse_r| +
  max_c |z_rc|``, ``w_max`` the largest class weight), and ``FP32_UNITS`` = 64 fp32 units of that cover
  exp / log and the sums over V = 32 classes (tolerances.py's argument); reduced like the loss (sum of
  rows, times 1/D for mean) plus 4 fp32 ulps of the result for the final division.
- gradient of the logits ``G``: each element is a sum of at most 3 terms of magnitude at most
  ``w_max * |upstream_r| * scale`` (``p_c f_r``, ``(1 - eps) w_t``, ``eps / V w_c``), ``p_c`` carrying a
  relative error of a few fp32 units of ``M_r``: ``3 * 64 u M_r w_max |up_r| scale``. Low-precision
  logits get ``G`` rounded to their dtype in both paths: one ulp apart at most (``2^(1-p) |G|``, p = 8
  bf16, 11 fp16, 24 fp32; the Triton interpreter truncates where a GPU rounds, still under one ulp), plus
  the fp16 subnormal spacing 2^-24.
- leaf gradients through the matmul (``G @ W``, ``G.T @ h``, ``sum_rows G``): the G bound carried through
  the same product with absolute values, plus 64 fp32 units of the product of magnitudes for the fp32
  accumulation order, plus one ulp of the result's dtype for the final rounding (both paths round a
  slightly different fp32 sum to nearest: at most one ulp apart).
Gradient dtypes must equal the leaves' dtypes exactly, and the loss is fp32 in both.
"""
import pytest
import torch
import torch.nn.functional as F

import fusedce
from tolerances import FP32_UNITS, U32

N, H, V = 8, 16, 32
EPS = 0.1
IGNORE = -100
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_BITS = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}
REDUCTIONS = ("mean", "sum", "none")


def _cpu_autocast_supports(dtype) -> bool:
    try:
        with torch.autocast("cpu", dtype=dtype):
            return F.linear(torch.ones(1, 2), torch.ones(3, 2)).dtype == dtype
    except (RuntimeError, ValueError):
        return False


@pytest.fixture(params=list(AUTOCAST_DTYPES))
def amp_dtype(request):
    dtype = AUTOCAST_DTYPES[request.param]
    if not _cpu_autocast_supports(dtype):
        pytest.skip(f"this torch build's CPU autocast does not support {dtype}")
    return dtype


# ------------------------------------------------------------------------------------------ inputs
def _data():
    h = torch.randn(N, H)
    w = torch.randn(V, H) * (2.0 / H ** 0.5)
    b = torch.randn(V) * 0.5
    t = torch.randint(0, V, (N,))
    t[0], t[1], t[5] = 0, V - 1, IGNORE
    cw = torch.rand(V) * 2.0 + 0.25
    up = torch.randn(N)
    return h, w, b, t, cw, up


def _leaves(*tensors):
    return [None if x is None else x.detach().clone().requires_grad_() for x in tensors]


def _grads(loss, leaves, reduction, up):
    return torch.autograd.grad(loss, leaves, up if reduction == "none" else None)


# ------------------------------------------------------------------------------------------ bounds
def _g_bound(z, t, cw, reduction, up, g_dtype):
    """Element-wise bound on |G_fused - G_stock| for logits ``z`` (any dtype; the values both paths use),
    and the per-row loss bound (see the module docstring)."""
    z = z.detach().double()
    valid = t != IGNORE
    m = 1.0 + torch.logsumexp(z, 1).abs() + z.abs().amax(1)
    w_max = float(cw.max())
    loss_rows = torch.where(valid, FP32_UNITS * U32 * w_max * (1.0 + EPS) * m, 0.0)
    scale = 1.0 / float(cw[t[valid]].sum()) if reduction == "mean" else 1.0
    up_r = up.double().abs() if reduction == "none" else torch.ones(N, dtype=torch.float64)
    g32 = torch.where(valid, 3 * FP32_UNITS * U32 * m * w_max * up_r * scale, 0.0)[:, None].expand(-1, V)
    return g32, loss_rows, scale


def _rounding(stock_g, g_dtype):
    ulp = 2.0 ** (1 - PRECISION_BITS[g_dtype])
    return ulp * stock_g.detach().double().abs() + (2.0 ** -24 if g_dtype == torch.float16 else 0.0)


def _loss_bound(loss_rows, scale, reduction, stock_loss):
    if reduction == "none":
        return loss_rows
    return loss_rows.sum() * scale + 4 * U32 * stock_loss.detach().double().abs()


def _check(name, actual, expected, bound, dtype):
    assert actual is not None and expected is not None, f"{name}: a gradient is missing"
    assert actual.dtype == dtype, f"{name}: dtype {actual.dtype}, expected {dtype}"
    assert expected.dtype == dtype, f"{name}: the stock gradient has dtype {expected.dtype}, expected {dtype}"
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    diff = (a - e).abs()
    bound = torch.broadcast_to(torch.as_tensor(bound, dtype=torch.float64), diff.shape)
    bad = diff > bound
    if bool(bad.any()):
        i = int(torch.argmax((diff - bound).reshape(-1)))
        raise AssertionError(f"{name}: {int(bad.sum())}/{diff.numel()} elements out of tolerance; worst: got "
                             f"{float(a.reshape(-1)[i])!r}, stock {float(e.reshape(-1)[i])!r}, |diff| "
                             f"{float(diff.reshape(-1)[i]):.3e} > {float(bound.reshape(-1)[i]):.3e}")


def _matmul_bounds(g_bound, stock_g, h_c, w_c, out_dtype):
    """Bounds of ``G @ W``, ``G.T @ h``, ``sum_rows G`` (the leaf gradients through the linear layer)."""
    g_abs = stock_g.detach().double().abs()
    h_abs, w_abs = h_c.detach().double().abs(), w_c.detach().double().abs()
    ulp = 2.0 ** (1 - PRECISION_BITS[out_dtype])
    per = FP32_UNITS * U32 + ulp
    return {"hidden": g_bound @ w_abs + per * (g_abs @ w_abs),
            "weight": g_bound.t() @ h_abs + per * (g_abs.t() @ h_abs),
            "bias": g_bound.sum(0) + per * g_abs.sum(0)}


# ------------------------------------------------------------------------------------------ ops
def _cross_entropy(op, logits, t, cw, reduction, backend):
    if op == "function":
        return fusedce.cross_entropy(logits, t, cw, reduction=reduction, label_smoothing=EPS, backend=backend)
    return fusedce.CrossEntropyLoss(cw, reduction=reduction, label_smoothing=EPS, backend=backend)(logits, t)


def _linear(op, h, w, t, b, cw, reduction, backend):
    """The linear op with ``logits_dtype="input"``: the stock composition's rounding of the logits to the
    autocast dtype, so that the bounds above (both paths on the same logits) apply; the default fp32
    logits are checked against float64 in tests/linear/test_fp32_logits.py."""
    if op == "function":
        return fusedce.linear_cross_entropy(h, w, t, b, ce_weight=cw, reduction=reduction,
                                            label_smoothing=EPS, backend=backend, logits_dtype="input")
    module = fusedce.LinearCrossEntropyLoss(cw, reduction=reduction, label_smoothing=EPS, backend=backend,
                                            logits_dtype="input")
    return module(h, w, t, b)


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("logits_from", ["fp32_leaf", "autocast_linear"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("op", ["function", "module"])
def test_cross_entropy_under_autocast(backend, amp_dtype, op, reduction, logits_from):
    """``fusedce.cross_entropy`` / ``CrossEntropyLoss`` vs ``F.cross_entropy`` under the same autocast."""
    h, w, b, t, cw, up = _data()
    logits32 = torch.randn(N, V) * 2.0

    def run(fn):
        if logits_from == "fp32_leaf":
            (x,) = leaves = _leaves(logits32)
            with torch.autocast("cpu", dtype=amp_dtype):
                loss = fn(x)
            return loss, _grads(loss, leaves, reduction, up), x.detach(), None
        leaves = _leaves(h, w, b)
        with torch.autocast("cpu", dtype=amp_dtype):
            z = F.linear(*leaves)
            loss = fn(z)
        grads = _grads(loss, [*leaves, z], reduction, up)
        return loss, grads[:3], z.detach(), grads[3]

    fused_loss, fused_grads, z, _ = run(lambda x: _cross_entropy(op, x, t, cw, reduction, backend))
    stock_loss, stock_grads, z_stock, stock_g = run(
        lambda x: F.cross_entropy(x, t, cw, ignore_index=IGNORE, reduction=reduction, label_smoothing=EPS))
    assert torch.equal(z, z_stock)   # both from the same values (the same F.linear under autocast)
    assert fused_loss.dtype == stock_loss.dtype == torch.float32

    g32, loss_rows, scale = _g_bound(z, t, cw, reduction, up, z.dtype)
    loss_bound = _loss_bound(loss_rows, scale, reduction, stock_loss)
    _check("loss", fused_loss, stock_loss, loss_bound, torch.float32)
    if logits_from == "fp32_leaf":   # the leaf gradient is G itself, fp32
        (g,) = stock_grads
        _check("grad_logits", fused_grads[0], g, g32 + _rounding(g, torch.float32), torch.float32)
        return
    g_bound = g32 + _rounding(stock_g, z.dtype)
    bounds = _matmul_bounds(g_bound, stock_g, h.to(amp_dtype), w.to(amp_dtype), amp_dtype)
    for name, got, want in zip(("hidden", "weight", "bias"), fused_grads, stock_grads):
        _check(f"grad_{name}", got, want, bounds[name], torch.float32)


@pytest.mark.parametrize("inputs", ["fp32_leaves", "mixed_leaves"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("op", ["function", "module"])
def test_linear_cross_entropy_under_autocast(backend, amp_dtype, op, reduction, inputs):
    """``fusedce.linear_cross_entropy`` / ``LinearCrossEntropyLoss`` vs
    ``F.cross_entropy(F.linear(h, w, b).float(), t)`` under the same autocast. ``mixed_leaves``: hidden
    in the autocast dtype, weight and bias fp32 (the dtype check runs after the cast)."""
    h, w, b, t, cw, up = _data()
    if inputs == "mixed_leaves":
        h = h.to(amp_dtype)

    def fused(hh, ww, bb):
        return _linear(op, hh, ww, t, bb, cw, reduction, backend)

    def stock(hh, ww, bb):
        z = F.linear(hh, ww, bb)
        return F.cross_entropy(z.float(), t, cw, ignore_index=IGNORE, reduction=reduction,
                               label_smoothing=EPS), z

    leaves = _leaves(h, w, b)
    with torch.autocast("cpu", dtype=amp_dtype):
        fused_loss = fused(*leaves)
    fused_grads = _grads(fused_loss, leaves, reduction, up)

    leaves_s = _leaves(h, w, b)
    with torch.autocast("cpu", dtype=amp_dtype):
        stock_loss, z = stock(*leaves_s)
    *stock_grads, stock_g = _grads(stock_loss, [*leaves_s, z], reduction, up)
    assert z.dtype == amp_dtype and fused_loss.dtype == stock_loss.dtype == torch.float32

    g32, loss_rows, scale = _g_bound(z, t, cw, reduction, up, amp_dtype)
    loss_bound = _loss_bound(loss_rows, scale, reduction, stock_loss)
    _check("loss", fused_loss, stock_loss, loss_bound, torch.float32)
    g_bound = g32 + _rounding(stock_g, amp_dtype)
    bounds = _matmul_bounds(g_bound, stock_g, h.to(amp_dtype), w.to(amp_dtype), amp_dtype)
    for name, leaf, got, want in zip(("hidden", "weight", "bias"), leaves, fused_grads, stock_grads):
        _check(f"grad_{name}", got, want, bounds[name], leaf.dtype)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_backward_inside_autocast(backend, reduction):
    """``backward()`` called inside the autocast region (autograd then runs the ops' backward formulas
    under autocast; "none" recomputes the linear chunks there): the same results as backward outside."""
    h, w, b, t, cw, up = _data()
    results = []
    for inside in (False, True):
        leaves = _leaves(h, w, b)
        logits = _leaves(torch.randn(N, V, generator=torch.Generator().manual_seed(0)))[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin = _linear("function", *leaves[:2], t, leaves[2], cw, reduction, backend)
            ce = _cross_entropy("function", logits, t, cw, reduction, backend)
            total = (lin + ce) if reduction != "none" else (lin + ce) * up
            if inside:
                total.sum().backward()
        if not inside:
            total.sum().backward()
        results.append([lin.detach(), ce.detach(), *(x.grad for x in (*leaves, logits))])
    for outside, inside in zip(*results):
        assert outside.dtype == inside.dtype
        torch.testing.assert_close(inside, outside, rtol=0, atol=0)


def test_no_autocast_dtype_check_unchanged():
    """Without autocast, hidden / weight of different dtypes still raise ``TypeError`` (the cast is
    autocast's, not a silent conversion)."""
    h, w, _, t, _, _ = _data()
    with pytest.raises(TypeError, match="dtype"):
        fusedce.linear_cross_entropy(h.bfloat16(), w, t, backend="torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):   # under autocast: accepted, as F.linear is
        loss = fusedce.linear_cross_entropy(h.bfloat16(), w, t, backend="torch")
    assert loss.dtype == torch.float32


def test_compiled_under_autocast(backend):
    """The autocast handling traces: ``torch.compile(fullgraph=True)`` under CPU bf16 autocast equals the
    eager call under the same autocast."""
    h, w, b, t, cw, _ = _data()

    def step(hh, ww, bb):
        return fusedce.linear_cross_entropy(hh, ww, t, bb, ce_weight=cw, label_smoothing=EPS, backend=backend)

    out = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = _leaves(h, w, b)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(*leaves)
        out.append([loss.detach(), *torch.autograd.grad(loss, leaves)])
    for eager, compiled in zip(*out):
        assert eager.dtype == compiled.dtype
        # one bf16 ulp (2^-7 relative) of the largest element: Inductor may order fp32 sums differently
        torch.testing.assert_close(compiled, eager, rtol=2.0 ** -7,
                                   atol=2.0 ** -7 * float(eager.abs().max()))


def test_keyword_arguments_under_autocast():
    """hidden / weight / bias passed by keyword are cast like positional ones (both entry points; the
    stock rounding of the logits, ``logits_dtype="input"``, so the logits op on ``F.linear`` matches)."""
    h, w, b, t, _, _ = _data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        positional = fusedce.linear_cross_entropy(h, w, t, b, backend="torch", logits_dtype="input")
        keywords = fusedce.linear_cross_entropy(hidden=h, weight=w, target=t, bias=b, backend="torch",
                                                logits_dtype="input")
        ce = fusedce.cross_entropy(logits=F.linear(h, w, b), target=t, backend="torch")
    assert torch.equal(positional, keywords) and torch.equal(keywords, ce)
