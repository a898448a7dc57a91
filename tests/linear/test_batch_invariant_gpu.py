"""``batch_invariant=True`` on a GPU (both methods, the compiled Triton kernels and the PyTorch backend on
CUDA): the CPU tests (``test_batch_invariant.py``, ``test_batch_invariant_tiled.py``) run the Triton kernels
in the interpreter, whose dots are numpy GEMMs and whose atomics are sequential; here the tensor-core dots
and the scheduling are the GPU's. Skipped without CUDA. Run on a GPU machine with
``python -m pytest -q tests/linear/test_batch_invariant_gpu.py`` (about a minute).

One probe row is placed into batches of 1 to 4097 rows (the 64-row tile crossed, many tiles) at the first,
a middle and the last position, with ignored neighbours in some; its log-prob, entropy, ``"none"`` loss,
lse and hidden-gradient rows are compared bit for bit with the probe alone.
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the CPU tests cover the interpreter)", allow_module_level=True)

import fusedce  # noqa: E402
from inputs import bit_identical  # noqa: E402

H, V = 1024, 32003
PLACEMENTS = [(63, 62, False), (64, 10, True), (65, 64, False), (1000, 500, True), (4097, 4096, False),
              (4097, 0, True)]


def _probe(weight, n, pos, ignored, backend, method):
    g = torch.Generator(device="cuda").manual_seed(1000 * n + pos)
    rows = torch.randn(n, H, device="cuda", generator=g).to(weight.dtype)
    target = torch.randint(0, V, (n,), device="cuda", generator=g)
    if ignored:
        target[::3] = -100
    probe = torch.randn(H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    rows[pos], target[pos] = probe.to(weight.dtype), 7
    h1, h2 = rows.clone().requires_grad_(), rows.clone().requires_grad_()
    kw = dict(backend=backend, method=method, batch_invariant=True)
    out = fusedce.linear_token_log_probs(h1, weight, target, return_entropy=True, **kw)
    (out.log_probs * 0.5 + out.entropy).sum().backward()
    ce = fusedce.linear_cross_entropy(h2, weight, target, reduction="none", return_stats=True, **kw)
    ce.loss.sum().backward()
    return [out.log_probs[pos], out.entropy[pos], h1.grad[pos], ce.loss[pos], ce.lse[pos], h2.grad[pos]]


@pytest.mark.parametrize("method", ["chunked", "tiled"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rows_are_batch_invariant_on_gpu(backend, method, dtype):
    weight = (torch.randn(V, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
              * 0.03).to(dtype)
    reference = [t.detach().clone() for t in _probe(weight, 1, 0, False, backend, method)]
    changed = [p for p in PLACEMENTS
               if not all(bit_identical(a.detach(), b) for a, b in zip(_probe(weight, *p, backend, method),
                                                                      reference))]
    assert changed == []
