"""``batch_invariant=True`` on the per-row distillation losses (the contract's 2026-12-02 addition, issue 29):
one probe token (student and teacher hidden states / logits, its target) placed in batches of 1 to 200 rows
at several positions, with and without ignored neighbours (every third row) and with and without a target,
several ``chunk_size`` values; its ``reduction="none"`` loss and its row of the student gradient must be
bitwise those of the probe alone. H, Ht and V odd-sized (no multiple of a vector width).
``test_linear_default_is_not_invariant`` shows the same placements change the probe's bits without the flag
(so the check can fail); the mean reduction's gradients equal float64's with the padding (its rows get no
gradient, the bias gradient included)."""
from __future__ import annotations

import pytest
import torch

import fusedce
from inputs import bit_identical

H, HT, V = 40, 24, 301
PROBE_TARGET = 7
PLACEMENTS = [(2, 1, 2, False), (5, 3, 4, True), (63, 62, 16, False), (64, 10, 64, True), (65, 64, 64, False),
              (130, 70, 50, True), (200, 199, 128, False), (200, 0, 7, True)]
TRITON_PLACEMENTS = [(5, 3, 4, True), (65, 64, 64, False)]
OPTIONS = dict(beta=0.5, temperature=2.0, reduction="none")


def _heads(dtype):
    g = torch.Generator().manual_seed(3)
    return ((torch.randn(V, H, generator=g) * 0.3).to(dtype), (torch.randn(V, HT, generator=g) * 0.3).to(dtype),
            torch.randn(V, generator=g).to(dtype))


def _batch(n, pos, ignored, widths, dtype, with_target):
    g = torch.Generator().manual_seed(1000 * n + pos)
    rows = [(torch.randn(n, w, generator=g) * 2).to(dtype) for w in widths]
    target = torch.randint(0, V, (n,), generator=g)
    if ignored:
        target[::3] = -100
    probe_g = torch.Generator().manual_seed(5)
    for r, w in zip(rows, widths):
        r[pos] = (torch.randn(w, generator=probe_g) * 2).to(dtype)
    target[pos] = PROBE_TARGET
    return rows, (target if with_target else None)


def _linear_probe(heads, n, pos, chunk, ignored, backend, with_target=True, **kw):
    ws, wt, bs = heads
    (hs, ht), target = _batch(n, pos, ignored, (H, HT), ws.dtype, with_target)
    hs.requires_grad_()
    extra = dict(hard_label_weight=0.3) if with_target else {}
    loss = fusedce.linear_distillation_loss(hs, ws, ht, wt, target, student_bias=bs, chunk_size=chunk,
                                            backend=backend, **OPTIONS, **extra, **kw)
    up = torch.linspace(0.5, 1.5, n)
    up[pos] = 1.0   # the neighbours' upstreams vary, the probe's is the same in every placement
    (loss * up).sum().backward()
    return loss[pos].detach(), hs.grad[pos]


def _logits_probe(n, pos, ignored, backend, dtype, width=V, **kw):
    (zs, zt), target = _batch(n, pos, ignored, (width, width), dtype, True)
    zs.requires_grad_()
    loss = fusedce.distillation_loss(zs, zt, target, backend=backend, hard_label_weight=0.3, **OPTIONS, **kw)
    loss.sum().backward()
    return loss[pos].detach(), zs.grad[pos]


def _changed(probe, reference, placements) -> int:
    return sum(not all(bit_identical(a, b) for a, b in zip(probe(*p), reference)) for p in placements)


@pytest.mark.parametrize("with_target", [True, False], ids=["target", "no-target"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_rows_are_batch_invariant(backend, dtype, with_target):
    if backend == "triton" and (dtype == torch.float32 or not with_target):
        pytest.skip("the Triton chunked path shares the GEMMs with torch; its row kernel is covered in bf16")
    heads = _heads(dtype)
    probe = lambda n, pos, chunk, ign: _linear_probe(heads, n, pos, chunk, ign and with_target, backend,
                                                     with_target, batch_invariant=True)
    placements = TRITON_PLACEMENTS if backend == "triton" else PLACEMENTS
    assert _changed(probe, probe(1, 0, 1, False), placements) == 0


def test_logits_rows_are_batch_invariant(backend):
    placements = TRITON_PLACEMENTS if backend == "triton" else PLACEMENTS
    probe = lambda n, pos, _chunk, ign: _logits_probe(n, pos, ign, backend, torch.float32, batch_invariant=True)
    assert _changed(probe, probe(1, 0, None, False), placements) == 0


def test_logits_long_rows_are_batch_invariant():
    """V = 150001: torch splits the reductions of a lone row that long between its intra-op threads (the
    loss of a row alone then differed from the same row's in a batch of three by 3e-8, measured); the
    PyTorch row op reduces a lone row on one thread, as every row of a larger block."""
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: nothing to split")
    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(3, 150001, generator=g) * 2, torch.randn(3, 150001, generator=g) * 2
    outs = []
    for rows in (slice(0, 1), slice(0, 3)):
        x = zs[rows].clone().requires_grad_()
        loss = fusedce.distillation_loss(x, zt[rows], beta=0.5, reduction="none", backend="torch",
                                         batch_invariant=True)
        loss.sum().backward()
        outs.append((loss[0].detach(), x.grad[0]))
    assert all(bit_identical(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("with_target", [True, False], ids=["target", "no-target"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiled_rows_are_batch_invariant(backend, dtype, with_target, monkeypatch):
    """``method="tiled"`` (issue 46 item 4; it was a ValueError): ``batch_invariant``'s PyTorch tiles are 64
    rows x 4 classes here (``tile_sizes(301, True)``), so the placements cross token tiles (63, 64, 65, 130,
    200 rows; the probe in a tile's first and last rows); Triton its own 64-row tiles."""
    if backend == "triton" and (dtype == torch.float32 or not with_target):
        pytest.skip("the interpreter is slow: the Triton tiled kernels in bf16 with a target")
    from fusedce.backends.pytorch import tuning as torch_tuning
    monkeypatch.setattr(torch_tuning, "TILE_ROWS", 24)
    monkeypatch.setattr(torch_tuning, "TILE_VOCAB", 32)
    assert torch_tuning.tile_sizes(V) == (9, 32) and torch_tuning.tile_sizes(V, True) == (64, 4)
    heads = _heads(dtype)
    probe = lambda n, pos, _chunk, ign: _linear_probe(heads, n, pos, None, ign and with_target, backend,
                                                      with_target, method="tiled", batch_invariant=True)
    placements = TRITON_PLACEMENTS if backend == "triton" else PLACEMENTS
    assert _changed(probe, probe(1, 0, None, False), placements) == 0


def test_tiled_unpadded_is_not_invariant(monkeypatch):
    """Without the padding to whole tiles (``invariant_rows`` 1) the same placements change the probe's
    bits: the padding is what holds."""
    from fusedce.backends.pytorch import custom_ops
    monkeypatch.setattr(custom_ops.tiled_distill, "invariant_rows", lambda n_classes: 1)
    heads = _heads(torch.float32)
    probe = lambda n, pos, _chunk, ign: _linear_probe(heads, n, pos, None, ign, "torch", method="tiled",
                                                      batch_invariant=True)
    assert _changed(probe, probe(1, 0, None, False), PLACEMENTS[1:6]) > 0


def test_linear_default_is_not_invariant():
    heads = _heads(torch.float32)
    probe = lambda n, pos, chunk, ign: _linear_probe(heads, n, pos, chunk, ign, "torch")
    assert _changed(probe, probe(1, 0, 1, False), PLACEMENTS[2:5]) > 0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("with_target", [True, False], ids=["target", "no-target"])
def test_padding_changes_no_gradient(reduction, with_target):
    """70 rows (6 of padding in the second chunk): loss and every student gradient (bias included: the
    padding rows' logits would add to it if they got any gradient) equal those without the flag."""
    ws, wt, bs = _heads(torch.float32)
    (hs, ht), target = _batch(70, 3, with_target, (H, HT), torch.float32, with_target)
    results = []
    for flag in (False, True):
        leaves = [t.clone().requires_grad_() for t in (hs, ws, bs)]
        loss = fusedce.linear_distillation_loss(leaves[0], leaves[1], ht, wt, target, student_bias=leaves[2],
                                                beta=0.5, reduction=reduction, backend="torch",
                                                batch_invariant=flag)
        loss.backward()
        results.append([loss.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_refusals():
    ws, wt, _ = _heads(torch.float32)
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        fusedce.distillation_loss(torch.randn(4, V), torch.randn(4, V), batch_invariant="yes")
