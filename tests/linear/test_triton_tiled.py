"""The Triton tiled LM-head loss (``backends/triton/tiled.py``, ``method="tiled"``) against a float64
reference, under the Triton interpreter.

The reference is written here: float64 logits ``hidden @ weight.T + bias`` from the exact inputs, NOT
rounded to the inputs' dtype (the contract since 2026-12-02: fp32 logits from the operands' values, so
the kernel's only error is fp32's), then logit_scale, softcap, log_softmax, the entropy and
F.cross_entropy with smoothing and class weights. Gradients come from float64 autograd of the same
composition w.r.t. those logits, then the chain rule through the linear map (``G @ W``, ``G.T @ h``,
``sum_rows G``).

Shapes: n = 37 tokens, V = 150 classes, H = 40 (none a multiple of the shrunk tiles 16 x 64 x 16, so
every kernel has partial token, class and hidden tiles); a -inf bias block that covers whole class
tiles (classes 64..127: tile 1 is entirely -inf) and a target-free region; ignored rows, including a
whole token tile of them (rows 16..31: the kernels skip it).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from fusedce.backends.triton import tuning
from fusedce.backends.triton.linear import TRITON_TILED
from fusedce.core.options import LossOptions

N, V, H = 37, 150, 40
IGNORE = -100


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tuning, "tiled_config", lambda *a, **k: {
        "BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_H": 16, "num_warps": 4, "num_stages": 2})


def _inputs(dtype, bias=True, weights=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.4).to(dtype)
    b = (torch.randn(V, generator=g)).to(dtype) if bias else None
    if b is not None:
        b[64:128] = float("-inf")
    t = torch.randint(0, V, (N,), generator=g)
    if b is not None:
        t = torch.where((t >= 64) & (t < 128), t - 64, t)
    t[16:32] = IGNORE     # a whole 16-row tile ignored
    t[3] = IGNORE
    t[5] = V - 1          # last class
    cw = torch.rand(V, generator=g) + 0.5 if weights else None
    return h, w, b, t, cw


def _reference(h, w, b, t, cw, opts: LossOptions):
    """float64 per-row (loss, lse, entropy, z_t, predicted) and the exact logits (leaf)."""
    x = h.double() @ w.double().T + (0.0 if b is None else b.double())
    x = x.requires_grad_()     # the exact logits: the kernel forms them in fp32, never rounded to h's dtype
    z = x * opts.logit_scale
    if opts.softcap is not None:
        z = opts.softcap * torch.tanh(z / opts.softcap)
    valid = t != IGNORE
    lse = torch.logsumexp(z, 1)
    logp = z - lse[:, None]
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, 0.0)).sum(1)
    ce = F.cross_entropy(z, t, weight=None if cw is None else cw.double(), ignore_index=IGNORE, reduction="none",
                         label_smoothing=opts.label_smoothing)
    safe = torch.where(valid, t, 0)
    z_t = z.gather(1, safe[:, None])[:, 0]
    zero = torch.zeros(())
    rows = dict(loss=torch.where(valid, ce, zero), lse=torch.where(valid, lse, zero),
                entropy=torch.where(valid, ent, zero), target_logit=torch.where(valid, z_t, zero))
    pred = torch.where(valid, x.detach().argmax(1), -1)
    return x, rows, pred


OPTIONS = {
    "plain": (LossOptions(ignore_index=IGNORE), False),
    "smooth+weight": (LossOptions(ignore_index=IGNORE, label_smoothing=0.1), True),
    "softcap+scale": (LossOptions(ignore_index=IGNORE, softcap=3.0, logit_scale=0.7), False),
    "all": (LossOptions(ignore_index=IGNORE, label_smoothing=0.2, softcap=5.0, logit_scale=1.3), True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_tiled_forward_backward(dtype, name):
    opts, weights = OPTIONS[name]
    h, w, b, t, cw = _inputs(dtype, bias=name != "smooth+weight", weights=weights)
    wsum = None if cw is None else cw.sum()
    got = TRITON_TILED.forward(h, w, b, t, cw, wsum, opts, stats=True, entropy=True)
    x, ref, pred = _reference(h, w, b, t, cw, opts)
    for key in ("loss", "lse", "entropy", "target_logit"):
        a, e = getattr(got, key).double(), ref[key].detach()
        # fp32 logits (H = 40 exact products summed in fp32) and fp32 math: FP32_UNITS-style allowance of
        # the row's magnitude
        bound = 256 * 2.0 ** -24 * (1 + e.abs() + 2 * ref["lse"].detach().abs())
        assert torch.all((a - e).abs() <= bound), (key, (a - e).abs().max())
    assert torch.equal(got.predicted, pred)
    assert torch.all(got.lse_lo[t == IGNORE] == 0) and torch.all(got.loss[t == IGNORE] == 0)

    # backward of sum g loss + hl lse + k entropy, per-row upstreams
    gen = torch.Generator().manual_seed(1)
    g, hl, k = (torch.randn(N, generator=gen) for _ in range(3))
    total = (g * ref["loss"]).sum() + (hl * ref["lse"]).sum() + (k * ref["entropy"]).sum()
    (gx,) = torch.autograd.grad(total, x)
    gx = torch.nan_to_num(gx)   # -inf bias columns: p = 0, gradient 0
    want = {"h": gx @ w.double(), "w": gx.T @ h.double(), "b": gx.sum(0)}
    gh, gw, gb = TRITON_TILED.backward(h, w, b, t, cw, wsum, got.lse, got.lse_lo, g, hl, opts,
                                       (True, True, True), torch.float32, grad_entropy=k, entropy=got.entropy)
    assert gh.dtype == dtype and gw.dtype == torch.float32 and (gb is None) == (b is None)
    assert torch.all(gh[t == IGNORE] == 0)
    # one rounding of dlogits to the dtype (as the chunked path stores them), fp32 sums of exact products
    u = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8
    g_abs = gx.abs()
    floors = {"h": g_abs @ w.double().abs(), "w": g_abs.T @ h.double().abs(), "b": g_abs.sum(0)}
    for key, got_g in (("h", gh), ("w", gw), ("b", gb)):
        if got_g is None:
            continue
        err = (got_g.double() - want[key]).abs()
        bound = 4 * u * floors[key] + 64 * 2.0 ** -24 * floors[key] * (1 + 2 * ref["lse"].abs().max().item())
        assert torch.all(err <= bound + 1e-7), (key, float((err - bound).max()))
        assert torch.isfinite(got_g).all()


def test_tiled_needs_accum_dtype_and_no_stats():
    h, w, b, t, _ = _inputs(torch.bfloat16)
    opts = LossOptions(ignore_index=IGNORE)
    rows = TRITON_TILED.forward(h, w, b, t, None, None, opts, stats=False)
    assert rows.entropy is None and torch.all(rows.predicted == -1)
    gh, gw, gb = TRITON_TILED.backward(h, w, b, t, None, None, rows.lse, rows.lse_lo,
                                       torch.ones(()).expand(N), None, opts, (False, True, True), torch.bfloat16)
    assert gh is None and gw.dtype == torch.bfloat16 and gb.dtype == torch.bfloat16
    _, gw32, gb32 = TRITON_TILED.backward(h, w, b, t, None, None, rows.lse, rows.lse_lo,
                                          torch.ones(()).expand(N), None, opts, (False, True, True), torch.float32)
    assert torch.equal(gw, gw32.to(torch.bfloat16)) and torch.equal(gb, gb32.to(torch.bfloat16))
    assert torch.all(gb32[64:128] == 0)          # the -inf bias block: p = 0 exactly, no NaN


def test_tiled_all_ignored_and_empty():
    h, w, b, t, _ = _inputs(torch.float32)
    t = torch.full_like(t, IGNORE)
    opts = LossOptions(ignore_index=IGNORE)
    rows = TRITON_TILED.forward(h, w, b, t, None, None, opts, stats=True, entropy=True)
    for v in (rows.loss, rows.lse, rows.lse_lo, rows.entropy, rows.target_logit):
        assert torch.all(v == 0)
    assert torch.all(rows.predicted == -1)
    gh, gw, gb = TRITON_TILED.backward(h, w, b, t, None, None, rows.lse, rows.lse_lo, torch.ones(N), None,
                                       opts, (True, True, True), torch.float32)
    assert torch.all(gh == 0) and torch.all(gw == 0) and torch.all(gb == 0)
    empty = TRITON_TILED.forward(h[:0], w, b, t[:0], None, None, opts, stats=True)
    assert empty.loss.shape == (0,)
    gh, gw, gb = TRITON_TILED.backward(h[:0], w, b, t[:0], None, None, empty.lse, empty.lse_lo, torch.ones(0),
                                       None, opts, (True, True, True), torch.float32)
    assert gh.shape == (0, H) and torch.all(gw == 0)


def test_tiled_out_of_range_target_is_nan():
    h, w, b, t, _ = _inputs(torch.float32, bias=False)
    t[0] = V + 3
    rows = TRITON_TILED.forward(h, w, None, t, None, None, LossOptions(ignore_index=IGNORE), stats=False)
    assert math.isnan(rows.loss[0].item()) and torch.isfinite(rows.loss[1:]).all()
