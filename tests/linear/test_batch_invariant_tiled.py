"""``batch_invariant=True`` with ``method="tiled"`` (the contract's 2026-12-06 addition: every method and
backend): a row's outputs and its row of the hidden gradient are bitwise the same whatever else is in the
batch.

As ``test_batch_invariant.py`` does for the chunked method: one probe row (a hidden state and its target)
is placed into batches of 1 to 300 rows at the first, a middle and the last position, with random
neighbours, with and without ignored neighbours (every third row); every per-row output of both linear
ops (``linear_cross_entropy``'s ``"none"`` row, its lse and predicted token, ``linear_token_log_probs``'s
log-prob, entropy and TRL statistics) and the probe's row of the hidden gradient of each op are compared
bit for bit with the probe alone in a batch of one. PyTorch backend: ``batch_invariant``'s tiles are 64 rows
(``tuning.INVARIANT_ROWS``) x 32 classes at V = 2053 (65 vocabulary tiles, the last 5 wide), so the sizes
straddle the token tile (63, 64, 65, 127, 128) and reach 300 (5 tiles), the probe in a tile's first, middle
and last row; one test keeps the shipped rule at V = 4099 (64 x 64). Triton (the interpreter, its own
64-token tiles): sizes 1 to 130 across the 64-row tile, tiny H and V. The two ``..._not_invariant`` tests
show that the check can fail: without the padding (a partial last tile), or with tiles of 18 rows (not whole
vectors: the last row's last values go through ATen's scalar loop), the same kind of placements change the
probe's bits.
"""
from __future__ import annotations

import pytest
import torch

import fusedce
from fusedce.backends.pytorch import custom_ops
from fusedce.backends.pytorch import tuning as torch_tuning
from inputs import bit_identical

PROBE_TARGET = 7
# (batch size, probe position, ignored neighbours)
PLACEMENTS = [(2, 1, False), (5, 3, True), (63, 62, False), (64, 63, False), (65, 64, True), (127, 126, False),
              (128, 127, False), (130, 70, True), (300, 299, False), (300, 0, True)]
# the Triton interpreter runs each program in Python: the 64-token tile crossed, up to 130 rows
TRITON_PLACEMENTS = [(5, 3, True), (65, 64, False), (130, 100, True)]


@pytest.fixture
def small_tiles(monkeypatch):
    """24 token rows x 64 classes per PyTorch tile (V = 2053), 64 x 32 with ``batch_invariant``."""
    monkeypatch.setattr(torch_tuning, "TILE_ROWS", 24)
    monkeypatch.setattr(torch_tuning, "TILE_VOCAB", 64)
    assert torch_tuning.tile_sizes(2053) == (24, 64) and torch_tuning.tile_sizes(2053, True) == (64, 32)


def _batch(n, pos, ignored, width, n_classes, dtype):
    g = torch.Generator().manual_seed(1000 * n + pos)
    rows = (torch.randn(n, width, generator=g) * 2).to(dtype)
    target = torch.randint(0, n_classes, (n,), generator=g)
    if ignored:
        target[::3] = -100
    probe = (torch.randn(width, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)
    rows[pos], target[pos] = probe, PROBE_TARGET
    return rows, target


def _probe(weight, bias, n, pos, ignored, backend, **kw):
    """Every per-row output of the probe and its hidden-gradient rows, inside one batch."""
    rows, target = _batch(n, pos, ignored, weight.shape[1], weight.shape[0], weight.dtype)
    h1, h2 = rows.clone().requires_grad_(), rows.clone().requires_grad_()
    out = fusedce.linear_token_log_probs(h1, weight, target, bias, return_entropy=True, return_stats=True,
                                         method="tiled", backend=backend, **kw)
    (out.log_probs * 0.5 + out.entropy).sum().backward()
    ce = fusedce.linear_cross_entropy(h2, weight, target, bias, reduction="none", return_stats=True,
                                      lse_square_scale=1e-3, method="tiled", backend=backend, **kw)
    ce.loss.sum().backward()
    return ([out.log_probs[pos], out.entropy[pos], out.log_sum_sq_probs[pos], out.mean_logits[pos],
             out.is_top1[pos], h1.grad[pos]]
            + [ce.loss[pos], ce.lse[pos], ce.predicted_tokens[pos], h2.grad[pos]])


def _head(n_classes, hidden, dtype):
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(n_classes, hidden, generator=g) * 0.3).to(dtype)
    return weight, (torch.randn(n_classes, generator=g) * 0.1).to(dtype)


def _changed(weight, bias, backend, placements, **kw) -> int:
    reference = [t.detach() for t in _probe(weight, bias, 1, 0, False, backend, **kw)]
    return sum(not all(bit_identical(a.detach(), b) for a, b in zip(_probe(weight, bias, *p, backend, **kw),
                                                                    reference))
               for p in placements)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_tiled_rows_are_batch_invariant(small_tiles, dtype):
    weight, bias = _head(2053, 40, dtype)
    assert _changed(weight, bias, "torch", PLACEMENTS, batch_invariant=True) == 0


def test_torch_tiled_shipped_tiles_are_batch_invariant():
    """The shipped tile rule: 64 rows x 64 classes at V = 4099 with the flag (16 x 256 without)."""
    weight, bias = _head(4099, 64, torch.float32)
    assert torch_tuning.tile_sizes(4099) == (16, 256) and torch_tuning.tile_sizes(4099, True) == (64, 64)
    assert _changed(weight, bias, "torch", [(15, 14, False), (64, 63, True), (200, 127, False)],
                    batch_invariant=True) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_tiled_rows_are_batch_invariant(dtype):
    """fp32 and bf16 have different tiles (``tuning.tiled_config``)."""
    weight, bias = _head(301, 40, dtype)
    assert _changed(weight, bias, "triton", TRITON_PLACEMENTS, batch_invariant=True) == 0


def test_unpadded_tiles_are_not_invariant(small_tiles, monkeypatch):
    """Without the padding to whole tiles (``invariant_rows`` 1: a partial last tile of other heights) the
    same placements change the probe's fp32 bits (measured: in all of them; the row sums of a block depend
    on its height too, not only the GEMMs): the padding is what holds."""
    monkeypatch.setattr(custom_ops.TorchTiledOps, "invariant_rows", staticmethod(lambda n_classes: 1))
    weight, bias = _head(2053, 40, torch.float32)
    assert _changed(weight, bias, "torch", PLACEMENTS[1:5], batch_invariant=True) > 0


def test_tiles_of_partial_vectors_are_not_invariant(monkeypatch):
    """Tiles of 9 rows x 32 classes at V = 301 (``INVARIANT_ROWS`` 9): the last vocabulary tile is 9 x 13 =
    117 values, whose last ones (the last row's) ATen's elementwise loops compute with scalar code: a probe
    in a tile's last row changes its bits (measured; rows a multiple of 64 are whole vectors)."""
    monkeypatch.setattr(torch_tuning, "TILE_VOCAB", 32)
    monkeypatch.setattr(torch_tuning, "INVARIANT_ROWS", 9)
    assert torch_tuning.tile_sizes(301, True) == (9, 32)
    weight, bias = _head(301, 40, torch.float32)
    assert _changed(weight, bias, "torch", [(9, 8, False), (18, 17, False), (27, 26, False)],
                    batch_invariant=True) > 0


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_padding_changes_no_result(small_tiles, backend_name):
    """49 rows (one tile and a partial one on PyTorch) with ignored rows: mean loss and every gradient
    (weight and bias included: the padding rows would add to them if they got any gradient) equal those
    without the flag to fp32 rounding."""
    weight, bias = _head(2053 if backend_name == "torch" else 301, 40, torch.float32)
    rows, target = _batch(49, 3, True, 40, weight.shape[0], torch.float32)
    results = []
    for flag in (False, True):
        leaves = [t.clone().requires_grad_() for t in (rows, weight, bias)]
        loss = fusedce.linear_cross_entropy(leaves[0], leaves[1], target, leaves[2], method="tiled",
                                            backend=backend_name, batch_invariant=flag)
        loss.backward()
        results.append([loss.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_module_takes_tiled():
    """The module accepts the pair (it was a ValueError) and passes both on."""
    module = fusedce.LinearCrossEntropyLoss(method="tiled", batch_invariant=True, reduction="none",
                                            backend="torch")
    weight, bias = _head(2053, 40, torch.float32)
    rows, target = _batch(30, 4, True, 40, 2053, torch.float32)
    alone = module(rows[4:5], weight, target[4:5])
    assert bit_identical(module(rows, weight, target)[4], alone[0])


@pytest.mark.parametrize("n_classes", [65, 301, 4099, 49152, 128256])
def test_invariant_tiles_are_whole_vectors_below_v(n_classes):
    """The shipped rule with the flag: rows a multiple of 64, and every block below V logits (the tiled
    method's memory contract) from V = 65 on."""
    rows, vocab = torch_tuning.tile_sizes(n_classes, True)
    assert rows % torch_tuning.INVARIANT_ROWS == 0 and rows * vocab < n_classes and vocab >= 1
    assert custom_ops.TorchTiledOps.invariant_rows(n_classes) == rows
