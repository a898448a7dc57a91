"""backend="cute" numerics on a GPU: parity against the float64 reference and against the Triton backend
on the same inputs, every option. Skipped without CUDA or without the cute extra (the CuTe DSL has no
CPU emulation; tests/cute/test_cute_compile.py is the CPU check). Run on a GPU machine with
``python -m pytest -q tests/cute/test_cute_gpu.py`` (benchmarks/gpu_check.sh runs it).

Shapes: V = 1000 (V % 16 == 8: 128-bit bf16 vectors need the launcher's vec rule), 4099 (odd: the scalar
variant), 128256 (Llama-3). bf16 errors are judged against the Triton backend on the same bf16 inputs.
"""
import pytest
import torch

pytest.importorskip("cutlass", reason="the cute extra (nvidia-cutlass-dsl) is not installed")
if not torch.cuda.is_available():
    pytest.skip("backend='cute' needs a CUDA GPU (no CPU emulation of CuTe DSL kernels)", allow_module_level=True)

import fusedce  # noqa: E402
from reference64 import reference_cross_entropy  # noqa: E402

OPTIONS = {
    "plain": {},
    "smooth": dict(label_smoothing=0.1),
    "softcap": dict(softcap=30.0),
    "zloss": dict(lse_square_scale=1e-4),
    "all": dict(label_smoothing=0.1, softcap=30.0, lse_square_scale=1e-4, logit_scale=0.5),
    "dft": dict(use_token_scaling=True),
}


def _inputs(n, v, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(n, v, device="cuda", generator=g) * 2).to(dtype)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::7] = -100
    return x, t


def _loss_and_grad(x, t, backend, **kw):
    x = x.clone().requires_grad_(True)
    out = fusedce.cross_entropy(x, t, backend=backend, return_stats=True, **kw)
    out.loss.backward()
    return out, x.grad


@pytest.mark.parametrize("v", [1000, 4099, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opt", list(OPTIONS))
@pytest.mark.parametrize("weighted", [False, True])
def test_cute_matches_reference_and_triton(v, dtype, opt, weighted):
    x, t = _inputs(64, v, dtype)
    kw = dict(OPTIONS[opt])
    if weighted:
        kw["weight"] = torch.rand(v, device="cuda") + 0.5
    ref = reference_cross_entropy(x, t, **kw)                              # float64 oracle (CPU)
    ref_grad = ref.grad.to("cuda")
    cute, cute_grad = _loss_and_grad(x, t, "cute", **kw)
    tri, tri_grad = _loss_and_grad(x, t, "triton", **kw)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cute.loss.double().cpu(), ref.loss, **tol)
    torch.testing.assert_close(cute.lse.double().cpu(), ref.lse, **tol)
    assert torch.equal(cute.predicted_tokens, tri.predicted_tokens)
    err_cute = (cute_grad.double() - ref_grad).abs().max().item()
    err_tri = (tri_grad.double() - ref_grad).abs().max().item()
    assert err_cute <= 2 * err_tri + 1e-7, (err_cute, err_tri)
    assert torch.all(cute_grad[t == -100] == 0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cute_linear_cross_entropy(reduction):
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(300, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(True)
    w = (torch.randn(5000, 64, device="cuda", generator=g) * 0.1).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, 5000, (300,), device="cuda", generator=g)
    t[::5] = -100
    res = {}
    for backend in ("cute", "triton"):
        h.grad = w.grad = None
        loss = fusedce.linear_cross_entropy(h, w, t, reduction=reduction, label_smoothing=0.1,
                                            lse_square_scale=1e-4, softcap=30.0, chunk_size=128, backend=backend)
        loss.sum().backward()
        res[backend] = (loss.detach().float(), h.grad.float(), w.grad.float())
    for a, b in zip(res["cute"], res["triton"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_cute_inplace_backward_and_all_ignored():
    x, t = _inputs(32, 4096, torch.bfloat16)
    expected, grad = _loss_and_grad(x, t, "triton")
    y = x.clone().requires_grad_(True)
    loss = fusedce.cross_entropy(y, t, backend="cute", inplace_backward=True)
    loss.backward()
    torch.testing.assert_close(loss, expected.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.grad.float(), grad.float(), rtol=2e-2, atol=1e-5)
    t_all = torch.full_like(t, -100)
    out, g = _loss_and_grad(x, t_all, "cute")
    assert out.loss.item() == 0.0 and torch.all(g == 0)


# The fused chunk kernel both ways: on chip (the row read once into shared memory; V picks 1, 2, 4 or 8
# CTAs per row, tuning.onchip_cluster) against the two-read kernel (FUSEDCE_CUTE_ONCHIP=0) on the same
# inputs. V = 4096 (one CTA), 65536 bf16 (128 KiB: a cluster of 2), 128256 (Llama-3: 4), 262144 (8);
# 1000 fp32 and 3000 bf16 (V % 8 != 0 in fp32 / bf16 would fall back; 1000 and 3000 are multiples of
# the full vector, so they stay on chip with a ragged last slice).
@pytest.mark.parametrize("v,dtype", [(4096, torch.bfloat16), (65536, torch.bfloat16), (128256, torch.bfloat16),
                                     (262144, torch.bfloat16), (1000, torch.float32), (3000, torch.bfloat16)])
@pytest.mark.parametrize("opt", ["plain", "all", "dft"])
@pytest.mark.parametrize("weighted", [False, True])
def test_cute_onchip_chunk_matches_two_read_chunk(v, dtype, opt, weighted, monkeypatch):
    from fusedce.backends.cute import launch, tuning
    from fusedce.core.options import LossOptions
    rows = 48
    x, t = _inputs(rows, v, dtype, seed=3)
    kw = dict(OPTIONS[opt])
    w = torch.rand(v, device="cuda") + 0.5 if weighted else None
    opts = LossOptions(**kw)
    g = torch.rand(rows, device="cuda")
    zg = torch.rand(rows, device="cuda")
    assert tuning.onchip_cluster(v, x.element_size(), True) is not None   # before the loop sets ONCHIP=0
    res = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("FUSEDCE_CUTE_ONCHIP", mode)
        buf = x.clone()
        outs = [torch.full((rows,), float("nan"), device="cuda") for _ in range(3)]
        pred = torch.full((rows,), -7, device="cuda", dtype=torch.int64)
        tw = torch.full((rows,), float("nan"), device="cuda") if opts.use_token_scaling else None
        launch.ce_chunk_(buf, t, w, None if w is None else w.sum().reshape(1), g, zg, opts, *outs, pred, tw)
        res[mode] = (buf, *outs, pred, tw)
    on, off = res["1"], res["0"]
    for a, b in zip(on[1:4], off[1:4]):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)
    assert torch.equal(on[4], off[4])
    if on[5] is not None:
        torch.testing.assert_close(on[5], off[5], rtol=2e-6, atol=1e-7)
    tol = dict(rtol=2e-6, atol=1e-8) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-6)
    torch.testing.assert_close(on[0].float(), off[0].float(), **tol)
    assert torch.all(on[0][t == -100] == 0)
