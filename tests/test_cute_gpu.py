"""backend="cute" numerics on a GPU: parity against the float64 reference and against the Triton backend
on the same inputs, every option. Skipped without CUDA or without the cute extra (the CuTe DSL has no
CPU emulation; tests/test_cute_compile.py is the CPU check). Run on a GPU machine with
``python -m pytest -q tests/test_cute_gpu.py`` (benchmarks/gpu_check.sh runs it).

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
