"""The entropy of the Triton row kernels (``TritonChunkCE.loss(..., entropy=True)`` and
``grad_(..., grad_entropy=, entropy=, out=)``) against float64, under the Triton interpreter.

Shapes: n = 9 rows, V = 1000 (not a power of two: one block of 1024 with 24 masked columns); a row
whose first 600 logits are -inf (masked vocabulary: 0 * -inf must not appear) and ignored rows. Every loss option, fp32
and bf16 logits (the reference uses the logits'
exact values). The gradient is of ``sum g loss + h lse + k entropy`` with random per-row upstreams.
"""
import pytest
import torch
import torch.nn.functional as F

from fusedce.backends.triton.linear import TritonChunkCE
from fusedce.core.options import LossOptions
from reference64_log_probs import entropy_of
from tolerances import TOLERANCES

N, V, IGNORE = 9, 1000, -100

OPTIONS = {
    "plain": (LossOptions(ignore_index=IGNORE), False),
    "smooth+weight": (LossOptions(ignore_index=IGNORE, label_smoothing=0.1), True),
    "softcap+scale": (LossOptions(ignore_index=IGNORE, softcap=4.0, logit_scale=0.6), False),
    "all": (LossOptions(ignore_index=IGNORE, label_smoothing=0.3, softcap=6.0, logit_scale=1.7), True),
}


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(N, V, generator=g) * 3).to(dtype)
    x[2, :600] = float("-inf")
    t = torch.randint(0, V, (N,), generator=g)
    t[2] = 700
    t[4] = IGNORE
    t[7] = IGNORE
    cw = torch.rand(V, generator=g) + 0.5
    return x, t, cw


def _reference(x, t, cw, opts):
    xd = x.double().requires_grad_()
    z = xd * opts.logit_scale
    if opts.softcap is not None:
        z = opts.softcap * torch.tanh(z / opts.softcap)
    valid = t != IGNORE
    lse = torch.logsumexp(z, 1)
    ent = entropy_of(z)   # the RL ops' reference: a -inf logit adds exactly 0
    ce = F.cross_entropy(z, t, weight=None if cw is None else cw.double(), ignore_index=IGNORE, reduction="none",
                         label_smoothing=opts.label_smoothing)
    zero = torch.zeros(())
    return xd, torch.where(valid, ce, zero), torch.where(valid, lse, zero), torch.where(valid, ent, zero)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_entropy_forward_and_gradient(dtype, name):
    opts, weighted = OPTIONS[name]
    x, t, cw = _inputs(dtype)
    cw = cw if weighted else None
    wsum = None if cw is None else cw.sum()
    loss, lse, lse_lo, pred, ent = TritonChunkCE.loss(x, t, cw, wsum, opts, True, entropy=True)
    xd, ref_loss, ref_lse, ref_ent = _reference(x, t, cw, opts)
    mag = 1 + ref_lse.detach().abs() + x.double().abs().nan_to_num(0, 0, 0).amax(1) * opts.logit_scale
    # smoothing without softcap on the -inf row: loss = +inf in both (its gradient is left out below)
    rows = torch.isfinite(ref_loss.detach())
    assert torch.equal(loss[~rows].double(), ref_loss.detach()[~rows])
    for got, want in ((loss, ref_loss), (lse, ref_lse), (ent, ref_ent)):
        assert got.dtype == torch.float32
        err = (got.double() - want.detach()).abs()[rows]
        assert torch.all(err <= 128 * 2.0 ** -24 * mag[rows]), err.max()
    assert torch.all(ent[t == IGNORE] == 0) and torch.all(pred[t == IGNORE] == -1)

    # the CE path is unchanged: 4 results, the same values
    plain = TritonChunkCE.loss(x, t, cw, wsum, opts, True)[:3]
    assert [torch.equal(a, b) for a, b in zip(plain, (loss, lse, lse_lo))] == [True] * 3

    gen = torch.Generator().manual_seed(1)
    g, h, k = (torch.randn(N, generator=gen) for _ in range(3))
    total = (g * ref_loss).sum() + (h * ref_lse).sum() + (k * ref_ent).sum()
    (want,) = torch.autograd.grad(total, xd)
    want = torch.nan_to_num(want)
    out = torch.full_like(x, float("nan"))            # poisoned: every element must be written
    TritonChunkCE.grad_(x, t, cw, wsum, lse, lse_lo, g, h, opts, grad_entropy=k, entropy=ent, out=out)
    tol = TOLERANCES[dtype]
    scale = (g.abs() + h.abs() + k.abs()).double()[:, None] * 4 * mag[:, None] * opts.logit_scale
    bound = tol.grad_rtol * want.abs() + 64 * 2.0 ** -24 * scale
    err = (out.double() - want).abs()[rows]
    assert torch.all(err <= bound[rows]), (err - bound[rows]).max()
    assert torch.all(out[t == IGNORE] == 0)

    inplace = x.clone()                                 # out=None: over the logits
    TritonChunkCE.grad_(inplace, t, cw, wsum, lse, lse_lo, g, h, opts, grad_entropy=k, entropy=ent)
    assert torch.equal(inplace[rows], out[rows])


def test_entropy_of_a_one_hot_and_a_uniform_row():
    x = torch.full((2, 256), -float("inf"))
    x[0, 17] = 3.0                     # one finite logit: entropy exactly 0
    x[1] = 0.5                         # uniform: log V
    t = torch.tensor([17, 3])
    _, _, _, _, ent = TritonChunkCE.loss(x, t, None, None, LossOptions(), False, entropy=True)
    assert ent[0].item() == 0.0
    assert abs(ent[1].item() - torch.log(torch.tensor(256.0)).item()) < 1e-6
