"""The top-k distillation tests' shapes (V = 300: a partial last Triton block; K = 6), small PyTorch tiles,
the hard target and the bound check (``tests/distill/test_topk_distillation.py``, ``test_topk_tail.py``)."""
import pytest
import torch

from fusedce.backends.pytorch import tuning as torch_tuning


HIDDEN, V, K = 16, 300, 6


@pytest.fixture(autouse=True)
def tiny_tiles(monkeypatch):
    monkeypatch.setattr(torch_tuning, "TILE_ROWS", 4)
    monkeypatch.setattr(torch_tuning, "TILE_VOCAB", 64)


def make_hard_target(lead, ignore_index=-100):
    t = torch.randint(0, V, lead).reshape(-1)
    t[2::4] = ignore_index
    return t.reshape(lead)


def check(actual, expected, atol, rtol=0.0, name=""):
    err = (actual.detach().double() - expected).abs().max().item() if expected.numel() else 0.0
    bound = atol + rtol * (expected.abs().max().item() if expected.numel() else 0.0)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"
