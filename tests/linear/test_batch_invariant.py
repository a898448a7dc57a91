"""``batch_invariant=True`` (the contract's 2026-12-02 addition): a row's outputs and its row of the input
gradient are bitwise the same whatever else is in the batch.

One probe row (a hidden state or a logits row, and its target) is placed into batches of 1 to 200 rows
at the first, a middle and the last position, with random neighbours, with and without ignored
neighbours (every third row), and for the linear ops with several ``chunk_size`` values; its log-prob,
entropy, cross-entropy row and gradient row are compared bit for bit with the probe alone in a batch
of one. The sizes straddle the 64-row chunk (63, 64, 65, 130) and reach 200. H and V are odd-sized
(H = 40, V = 301) so no shape is a multiple of a vector width; ``test_default_is_not_invariant`` shows
that, without the flag, the same placements change the probe's fp32 bits (so the check can fail).
"""
from __future__ import annotations

import pytest
import torch

import fusedce
from inputs import bit_identical

H, V = 40, 301
PROBE_TARGET = 7
# (batch size, probe position, chunk_size, ignored neighbours)
PLACEMENTS = [(2, 1, 2, False), (5, 3, 4, True), (63, 62, 16, False), (64, 10, 64, True), (65, 64, 64, False),
              (130, 70, 50, True), (200, 199, 128, False), (200, 0, 7, True)]
# the Triton interpreter runs each row program in Python: two placements, across the 64-row boundary
TRITON_PLACEMENTS = [(5, 3, 4, True), (65, 64, 64, False)]


def _batch(n, pos, ignored, width, dtype, seed):
    g = torch.Generator().manual_seed(1000 * n + pos)
    rows = (torch.randn(n, width, generator=g) * 2).to(dtype)
    target = torch.randint(0, V, (n,), generator=g)
    if ignored:
        target[::3] = -100
    probe = (torch.randn(width, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)
    rows[pos], target[pos] = probe, PROBE_TARGET
    return rows.requires_grad_(), target


def _linear_probe(weight, n, pos, chunk, ignored, backend, **kw):
    """The probe's (log-prob, entropy, CE row, hidden-gradient row) inside one batch."""
    hidden, target = _batch(n, pos, ignored, H, weight.dtype, seed=5)
    out = fusedce.linear_token_log_probs(hidden, weight, target, return_entropy=True, chunk_size=chunk,
                                         backend=backend, **kw)
    (out.log_probs * 0.5 + out.entropy).sum().backward()
    ce = fusedce.linear_cross_entropy(hidden.detach(), weight, target, reduction="none", chunk_size=chunk,
                                      backend=backend, **kw)
    return out.log_probs[pos].detach(), out.entropy[pos].detach(), ce[pos], hidden.grad[pos]


def _logits_probe(n, pos, ignored, backend, dtype, **kw):
    logits, target = _batch(n, pos, ignored, V, dtype, seed=6)
    out = fusedce.token_log_probs(logits, target, return_entropy=True, backend=backend, **kw)
    ce = fusedce.cross_entropy(logits, target, reduction="none", backend=backend, **kw)
    (out.log_probs * 0.5 + out.entropy + ce).sum().backward()
    return out.log_probs[pos].detach(), out.entropy[pos].detach(), ce[pos].detach(), logits.grad[pos]


def _changed(probe, reference, backend="torch", placements=None) -> int:
    placements = placements or (TRITON_PLACEMENTS if backend == "triton" else PLACEMENTS)
    return sum(not all(bit_identical(a, b) for a, b in zip(probe(*p), reference)) for p in placements)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_rows_are_batch_invariant(backend, dtype):
    if backend == "triton" and dtype == torch.float32:
        pytest.skip("the Triton chunked path shares the GEMMs with torch; its row kernels are covered in bf16")
    weight = (torch.randn(V, H, generator=torch.Generator().manual_seed(3)) * 0.3).to(dtype)
    probe = lambda n, pos, chunk, ign: _linear_probe(weight, n, pos, chunk, ign, backend, batch_invariant=True)
    assert _changed(probe, probe(1, 0, 1, False), backend) == 0


def test_logits_rows_are_batch_invariant(backend):
    probe = lambda n, pos, _chunk, ign: _logits_probe(n, pos, ign, backend, torch.float32, batch_invariant=True)
    assert _changed(probe, probe(1, 0, None, False), backend) == 0


def test_default_is_not_invariant():
    """Without the flag the chunk's row count changes the GEMMs' shapes and, with them, the probe's bits
    in at least one of three placements (fp32, PyTorch backend; 11 of 12 placements when measured)."""
    weight = torch.randn(V, H, generator=torch.Generator().manual_seed(3)) * 0.3
    probe = lambda n, pos, chunk, ign: _linear_probe(weight, n, pos, chunk, ign, "torch")
    assert _changed(probe, probe(1, 0, 1, False), placements=PLACEMENTS[2:5]) > 0


def test_batch_invariant_refusals():
    hidden, target = torch.randn(4, H), torch.randint(0, V, (4,))
    weight = torch.randn(V, H)
    with pytest.raises(ValueError, match=r"\(\.\.\., K\) target"):
        fusedce.linear_token_log_probs(hidden, weight, target[:, None].repeat(1, 2), batch_invariant=True)
    with pytest.raises(ValueError, match="probability targets"):
        fusedce.linear_cross_entropy(hidden, weight, torch.softmax(torch.randn(4, V), 1), batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        fusedce.cross_entropy(torch.randn(4, V), target, batch_invariant=1)
