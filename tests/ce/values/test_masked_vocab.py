"""Masked or padded vocabulary: logits of -inf (single-process side; the vocab-parallel
side, case C13, is in test_distributed.py). Every place that merges per-block (max, sum-exp) pairs must
treat a block whose logits are all -inf as contributing exactly 0: the Triton forward's online softmax
over BLOCK_V = 4096 columns, and the torch backend's row chunks.

Shapes: V = 8192 + 5 gives the Triton forward three blocks, the middle one wholly -inf in masked rows
(and, with the first block masked too, a row whose running max is -inf for two blocks); V = 8 is C13's row.
"""
from __future__ import annotations

import pytest
import torch

import fusedce
from reference64 import reference_cross_entropy
from tolerances import assert_grad_close, assert_loss_close

INF = float("inf")


def test_c13_row_single_process(backend):
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, -INF, -INF, -INF, -INF]], requires_grad=True)
    loss = fusedce.cross_entropy(x, torch.tensor([2]), backend=backend)
    assert abs(float(loss) - 1.4401897) <= 1e-6, float(loss)
    loss.backward()
    assert bool(torch.isfinite(x.grad).all()) and bool((x.grad[0, 4:] == 0).all())


@pytest.mark.parametrize("options", [{}, {"softcap": 30.0}, {"weighted": True}, {"lse_square_scale": 1e-3}])
def test_masked_blocks(backend, options):
    kw = dict(options)
    n_cols = 8192 + 5
    x = torch.randn(6, n_cols) * 2
    x[0, 4096:8192] = -INF                 # the middle block
    x[1, :8192] = -INF                     # the first two blocks: running max -inf for two blocks
    x[2, ::2] = -INF                       # every other class (a padded vocabulary)
    x[3, 5:] = -INF
    t = torch.tensor([3, 8192 + 2, 7, 4, 100, -100])
    w = torch.rand(n_cols) + 0.5 if kw.pop("weighted", False) else None
    xr = x.clone().requires_grad_()
    loss = fusedce.cross_entropy(xr, t, w, backend=backend, **kw)
    loss.backward()
    ref = reference_cross_entropy(x, t, w, **kw)
    assert_loss_close(loss, ref, torch.float32)
    assert_grad_close(xr.grad, ref, torch.float32)


def test_ignored_row_all_minus_inf(backend):
    """A wholly masked row that is ignored: loss 0 and gradient exactly 0, no NaN anywhere."""
    x = torch.randn(3, 40)
    x[1] = -INF
    t = torch.tensor([2, -100, 5])
    xr = x.clone().requires_grad_()
    out = fusedce.cross_entropy(xr, t, backend=backend, lse_square_scale=1e-3, return_stats=True)
    out.loss.backward()
    assert bool(torch.isfinite(out.loss)) and bool(torch.isfinite(xr.grad).all())
    assert bool((xr.grad[1] == 0).all()) and float(out.lse[1]) == 0.0
