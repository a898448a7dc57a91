"""The oracle checks itself: reference64 against the contract's formulas written out independently
(per-row loop, no F.cross_entropy) and against F.cross_entropy's own "mean" where they coincide."""
import math

import pytest
import torch
import torch.nn.functional as F

from inputs import make_logits, make_target, make_weight
from reference64 import reference_cross_entropy


def _contract_rows(x, t, w, ignore_index, eps, s, softcap):
    """The contract's per-row formula, literally, one row at a time in float64: (ce rows, z-loss rows)."""
    x = x.detach().double()
    n_classes = x.shape[-1]
    z = x if softcap is None else softcap * torch.tanh(x / softcap)
    w = torch.ones(n_classes, dtype=torch.float64) if w is None else w.double()
    ce, zl = [], []
    for zr, tr in zip(z.reshape(-1, n_classes), t.reshape(-1).tolist()):
        if tr == ignore_index:
            ce.append(0.0)
            zl.append(0.0)
            continue
        lse = float(torch.logsumexp(zr, 0))
        nll = lse - float(zr[tr])
        smooth = float((w * (lse - zr)).sum())
        ce.append((1 - eps) * float(w[tr]) * nll + eps / n_classes * smooth)
        zl.append(s * lse * lse)
    return torch.tensor(ce, dtype=torch.float64), torch.tensor(zl, dtype=torch.float64)


@pytest.mark.parametrize("weighted", [False, True])
def test_rows_match_contract_formula(weighted):
    x = make_logits((9, 40), torch.float32, scale=30.0)
    t = make_target((9,), 40, ignore_every=3, ignore_index=-1)
    w = make_weight(40) if weighted else None
    kw = dict(ignore_index=-1, label_smoothing=0.3, lse_square_scale=0.05, softcap=20.0)
    ref = reference_cross_entropy(x, t, w, reduction="none", **kw)
    ce, zl = _contract_rows(x, t, w, -1, 0.3, 0.05, 20.0)
    assert torch.allclose(ref.loss, ce + zl, rtol=1e-12, atol=1e-12)
    d = float((w[t[t != -1]] if weighted else (t != -1)).double().sum())
    n = float((t != -1).sum())
    mean = reference_cross_entropy(x, t, w, reduction="mean", **kw).loss
    # the contract's mean: sum(ce_row) / D + sum(z_row) / N (the z-loss is not class-weighted)
    assert math.isclose(float(mean), float(ce.sum()) / d + float(zl.sum()) / n, rel_tol=1e-12)


@pytest.mark.parametrize("weighted", [False, True])
def test_mean_matches_torch_mean(weighted):
    """Without z-loss and softcap the contract's mean is F.cross_entropy's weighted mean."""
    x = make_logits((11, 30), torch.float32)
    t = make_target((11,), 30, ignore_every=4)
    w = make_weight(30) if weighted else None
    ref = reference_cross_entropy(x, t, w, label_smoothing=0.2)
    x64 = x.detach().double().requires_grad_()
    torch_mean = F.cross_entropy(x64, t, None if w is None else w.double(), label_smoothing=0.2)
    (torch_grad,) = torch.autograd.grad(torch_mean, x64)
    assert math.isclose(float(ref.loss), float(torch_mean.detach()), rel_tol=1e-12)
    assert torch.allclose(ref.grad, torch_grad, rtol=1e-10, atol=1e-15)


def test_zero_denominator_and_upstream():
    x = make_logits((5, 7), torch.float32)
    t = torch.full((5,), -100)
    ref = reference_cross_entropy(x, t)
    assert float(ref.loss) == 0.0 and bool((ref.grad == 0).all())
    t = make_target((5,), 7)
    ref0 = reference_cross_entropy(x, t, num_items_in_batch=0)
    assert float(ref0.loss) == 0.0 and bool((ref0.grad == 0).all())
    r1 = reference_cross_entropy(x, t, reduction="sum")
    r2 = reference_cross_entropy(x, t, reduction="sum", upstream=3.0)
    assert torch.allclose(r2.grad, 3.0 * r1.grad, rtol=1e-14, atol=0)
    up = torch.randn(5)
    rn = reference_cross_entropy(x, t, reduction="none", upstream=up)
    single = [reference_cross_entropy(x[i:i + 1], t[i:i + 1], reduction="sum").grad[0] * up[i] for i in range(5)]
    assert torch.allclose(rn.grad, torch.stack(single).double(), rtol=1e-12, atol=1e-15)
