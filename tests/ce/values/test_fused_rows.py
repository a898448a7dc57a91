"""The PyTorch backend's one-pass forward + gradient of a chunk (``backends/pytorch/fused_rows.py``, the
chunked LM head's ``ChunkCE.loss_and_grad_``): the same loss, lse pair, argmax and token weight as the
composition it replaces (``protocol.loss_then_grad_``: ``loss`` then ``grad_``), bit for bit, for every
option; a gradient as close to float64 as that composition's and as ``F.cross_entropy``'s; exact zeros
on ignored rows; the caller's ``out`` / dtype handling; and rows whose bits do not depend on the rest of
the chunk (``batch_invariant``), now that the CPU blocks run on threads of their own."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from fusedce.backends.protocol import loss_then_grad_
from fusedce.backends.pytorch.linear import TorchChunkCE
from fusedce.core.options import LossOptions

OPTIONS = list(itertools.product([0.0, 0.1], [None, 20.0], [1.0, 0.5], [0.0, 1e-3], [False, True], [False, True]))


def _inputs(n, v, dtype, seed=0, weighted=False):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=gen) * 4).to(dtype)
    t = torch.randint(0, v, (n,), generator=gen)
    t[1] = -100
    t[n // 2] = -100
    w = torch.rand(v, generator=gen) + 0.1 if weighted else None
    g, zg = torch.rand(n, generator=gen), torch.rand(n, generator=gen)
    return x, t, w, None if w is None else w.sum(), g, zg


def _reference_grad(x, t, w, g, zg, opts):
    """float64 d(sum_i g_i ce_i p_t^tsc + zg_i s lse_i**2 p_t^tsc)/dx."""
    z = x.double().requires_grad_()
    zz = z * opts.logit_scale
    if opts.softcap is not None:
        zz = torch.tanh(zz / opts.softcap) * opts.softcap
    kept = (t != -100).double()
    ce = F.cross_entropy(zz, t, weight=None if w is None else w.double(), reduction="none",
                         label_smoothing=opts.label_smoothing)
    scale = torch.exp(-F.cross_entropy(zz, t, reduction="none")).detach() if opts.use_token_scaling else 1.0
    lse = torch.logsumexp(zz, 1)
    total = (ce * scale * g.double()).sum() + (opts.lse_square_scale * lse ** 2 * kept * scale * zg.double()).sum()
    total.backward()
    return z.grad


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("ls,cap,scale,zl,tsc,weighted", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_chunk_matches_the_composition(ls, cap, scale, zl, tsc, weighted, dtype):
    opts = LossOptions(label_smoothing=ls, softcap=cap, logit_scale=scale, lse_square_scale=zl,
                       use_token_scaling=tsc)
    x, t, w, ws, g, zg = _inputs(23, 301, dtype, weighted=weighted)
    composed, fused = x.clone(), x.clone()
    ref_out = loss_then_grad_(TorchChunkCE, composed, t, w, ws, g, zg, opts, True)
    out = TorchChunkCE.loss_and_grad_(fused, t, w, ws, g, zg, opts, True)
    for name, a, b in zip(("loss", "lse", "lse_lo", "predicted", "token_weight"), ref_out, out):
        if a is None:
            assert b is None, name
        else:
            assert torch.equal(a, b), name
    assert fused.dtype == dtype
    assert torch.all(fused[t == -100] == 0)
    ref = _reference_grad(x, t, w, g, zg, opts)
    # the composition's error, plus one rounding of the result's dtype (the two formulas round differently)
    slack = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -8
    assert _rel(fused, ref) <= _rel(composed, ref) * 1.25 + slack


@pytest.mark.parametrize("magnitude", [1.0, 1e2, 1e3])
def test_fused_gradient_is_as_accurate_as_torch_at_large_logits(magnitude):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 2048, generator=gen) * magnitude
    t = torch.randint(0, 2048, (64,), generator=gen)
    g = torch.full((64,), 1.0 / 64)
    fused = x.clone()
    TorchChunkCE.loss_and_grad_(fused, t, None, None, g, torch.zeros(64), LossOptions(), False)
    z = x.double().requires_grad_()
    F.cross_entropy(z, t).backward()
    s = x.clone().requires_grad_()
    F.cross_entropy(s, t).backward()
    assert _rel(fused, z.grad) <= 1.25 * _rel(s.grad, z.grad) + 2.0 ** -24


def test_a_row_has_the_same_bits_in_any_chunk():
    """Rows of one chunk reduced whole by one thread each: a row's loss and gradient are the same bits
    alone, in a chunk of 3 rows and in one of 40 (several CPU blocks on several threads)."""
    x, t, _, _, g, zg = _inputs(40, 50000, torch.float32, seed=2)
    opts = LossOptions(label_smoothing=0.05)
    full = x.clone()
    loss_full = TorchChunkCE.loss_and_grad_(full, t, None, None, g, zg, opts, True)[0]
    for rows in (slice(7, 8), slice(6, 9), slice(0, 40)):
        part = x[rows].clone()
        loss = TorchChunkCE.loss_and_grad_(part, t[rows], None, None, g[rows], zg[rows], opts, True)[0]
        assert torch.equal(loss, loss_full[rows])
        assert torch.equal(part, full[rows])


def test_an_all_ignored_chunk_is_zero_and_out_of_range_targets_are_nan():
    x, t, _, _, g, zg = _inputs(6, 50, torch.float32)
    ignored = torch.full((6,), -100)
    grad = x.clone()
    loss, lse, lse_lo, predicted, _ = TorchChunkCE.loss_and_grad_(grad, ignored, None, None, g, zg,
                                                                  LossOptions(), True)
    assert torch.all(grad == 0) and torch.all(loss == 0) and torch.all(lse == 0) and torch.all(predicted == -1)
    bad = t.clone()
    bad[0] = 50
    loss = TorchChunkCE.loss_and_grad_(x.clone(), bad, None, None, g, zg, LossOptions(), False)[0]
    assert torch.isnan(loss[0]) and torch.isfinite(loss[2:]).all()
