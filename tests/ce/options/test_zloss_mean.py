"""The contract's mean with a z-loss (docs/contract.md): ``sum(ce_row) / D + sum(z_row) / N``, where D is
the class-weighted count and N the plain count of non-ignored rows. Scaling the class weights by c then
leaves the mean (and the ``z_loss`` stat) unchanged, as ``F.cross_entropy``'s mean is, and the z-loss
part equals Liger's and flash-attn's (divided by the count of non-ignored rows).

The float64 oracle (reference64.py) encodes the formula and the rest of the suite checks every option
against it; these tests pin the property that distinguishes the two formulas, on both ops.
"""
from __future__ import annotations

import pytest
import torch

import fusedce
from inputs import make_logits, make_target, make_weight

S = 1e-2   # lse_square_scale: large enough that the z-loss is ~5% of the loss here


def _ce(x, t, w, backend, **kw):
    return fusedce.cross_entropy(x, t, w, lse_square_scale=S, backend=backend, return_stats=True, **kw)


def test_cross_entropy_mean_invariant_to_weight_scale(backend):
    x = make_logits((24, 50), torch.float32, scale=3.0)
    t = make_target((24,), 50, ignore_every=3)
    w = make_weight(50)
    outs = []
    for c in (1.0, 8.0):
        xc = x.detach().clone().requires_grad_()
        out = _ce(xc, t, w * c, backend)
        out.loss.backward()
        outs.append((out, xc.grad))
    (a, ga), (b, gb) = outs
    # scaling by a power of two is exact in fp32: the results agree to rounding of the sums
    assert abs(float(a.loss) - float(b.loss)) <= 2.0 ** -20 * abs(float(a.loss))
    assert abs(float(a.z_loss) - float(b.z_loss)) <= 2.0 ** -20 * abs(float(a.z_loss))
    assert float((ga - gb).abs().max()) <= 2.0 ** -20 * float(ga.abs().max())
    # and the z-loss part is the plain mean over non-ignored rows, not over sum(w[t])
    valid = t != -100
    lse = torch.logsumexp(x.detach().double(), -1)
    expected_z = S * float((lse[valid] ** 2).mean())
    assert abs(float(a.z_loss) - expected_z) <= 2.0 ** -20 * expected_z


def test_linear_cross_entropy_mean_invariant_to_weight_scale(backend):
    h = torch.randn(20, 16)
    w = torch.randn(40, 16) * 0.5
    t = make_target((20,), 40, ignore_every=4)
    cw = make_weight(40)
    results = []
    for c in (1.0, 8.0):
        hc = h.clone().requires_grad_()
        out = fusedce.linear_cross_entropy(hc, w, t, ce_weight=cw * c, lse_square_scale=S, chunk_size=8,
                                           return_stats=True, backend=backend)
        out.loss.backward()
        results.append((out, hc.grad))
    (a, ga), (b, gb) = results
    assert abs(float(a.loss) - float(b.loss)) <= 2.0 ** -20 * abs(float(a.loss))
    assert abs(float(a.z_loss) - float(b.z_loss)) <= 2.0 ** -20 * abs(float(a.z_loss))
    assert float((ga - gb).abs().max()) <= 2.0 ** -20 * float(ga.abs().max())


@pytest.mark.parametrize("num_items", [None, 11])
def test_z_loss_stat_and_loss_decomposition(backend, num_items):
    """loss = ce part + z part, z_loss = the z part: with class weights, the ce part is divided by D and
    the z part by N (both by num_items_in_batch when given)."""
    x = make_logits((16, 30), torch.float32)
    t = make_target((16,), 30, ignore_every=5)
    w = make_weight(30)
    out = _ce(x, t, w, backend, num_items_in_batch=num_items)
    plain = fusedce.cross_entropy(x, t, w, backend=backend, num_items_in_batch=num_items)
    assert abs(float(out.loss) - (float(plain) + float(out.z_loss))) <= 2.0 ** -21 * float(out.loss)
