"""Two loss options of the contract (docs/contract.md): ``logit_scale`` (Cohere's ``logit_scale``, Granite's
``1 / logits_scaling``: the logits are multiplied by it before anything else) and ``use_token_scaling``
(Dynamic Fine-Tuning, Liger's flag, TRL's ``loss_type="dft"``: each row's loss times its detached
``p_t``), on every op, reduction, backend and dtype, against the float64 oracle (reference64.py) under
the tolerance table (tolerances.py; reference64_linear.py for the linear op)."""
from __future__ import annotations

import pytest
import torch

import fusedce
from inputs import make_logits, make_target, make_weight
from reference64 import reference_cross_entropy
from reference64_linear import check_linear, make_linear
from tolerances import assert_grad_close, assert_loss_close

OPTIONS = {
    "scale": {"logit_scale": 0.0625},                                   # Cohere's value
    "scale+softcap": {"logit_scale": 1 / 8, "softcap": 5.0},           # Granite-like, capped
    "dft": {"use_token_scaling": True},
    "dft+all": {"use_token_scaling": True, "logit_scale": 2.0, "label_smoothing": 0.1,
                "lse_square_scale": 1e-3, "weighted": True},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("options", list(OPTIONS))
def test_cross_entropy(backend, options, dtype, reduction):
    kw = dict(OPTIONS[options])
    dt = DTYPES[dtype]
    x = make_logits((4, 9, 70), dt, scale=4.0)
    t = make_target((4, 9), 70, ignore_every=4)
    w = make_weight(70) if kw.pop("weighted", False) else None
    up = torch.randn(4, 9) if reduction == "none" else 1.7
    ref = reference_cross_entropy(x, t, w, reduction=reduction, upstream=up, **kw)
    out = fusedce.cross_entropy(x, t, w, reduction=reduction, backend=backend, return_stats=True, **kw)
    (grad,) = torch.autograd.grad(out.loss, x, up if reduction == "none" else torch.tensor(up))
    assert_loss_close(out.loss, ref, dt)
    assert_grad_close(grad, ref, dt)
    assert_loss_close(out.z_loss, type(ref)(**{**ref.__dict__, "loss": ref.z_loss}), dt, "z_loss")


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("options", list(OPTIONS))
def test_linear_cross_entropy(backend, options, reduction):
    kw = dict(OPTIONS[options])
    ce_weight = make_weight(45) if kw.pop("weighted", False) else None
    hidden, weight, bias = make_linear((3, 7), 16, 45, bias=True)
    target = make_target((3, 7), 45, ignore_every=4)
    up = torch.randn(3, 7) if reduction == "none" else None
    check_linear(hidden, weight, target, bias, backend=backend, upstream=up, ce_weight=ce_weight,
                 reduction=reduction, chunk_size=8, **kw)


def test_modules_pass_the_options(backend):
    x = make_logits((6, 30), torch.float32)
    t = make_target((6,), 30)
    kw = dict(logit_scale=0.5, use_token_scaling=True)
    mod = fusedce.CrossEntropyLoss(backend=backend, **kw)(x, t)
    assert torch.equal(mod, fusedce.cross_entropy(x, t, backend=backend, **kw))
    h, w = torch.randn(6, 8), torch.randn(30, 8)
    lmod = fusedce.LinearCrossEntropyLoss(backend=backend, **kw)(h, w, t)
    assert torch.equal(lmod, fusedce.linear_cross_entropy(h, w, t, backend=backend, **kw))
    plain = fusedce.cross_entropy(x, t, backend=backend)
    assert not torch.equal(mod, plain), "premise: the options change the loss"


@pytest.mark.parametrize("bad, exc", [(0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                                      (1e39, ValueError), (1e-45, ValueError), ("2", TypeError),
                                      (torch.tensor(2.0, requires_grad=True), TypeError)])
def test_logit_scale_errors(bad, exc):
    x, t = torch.randn(2, 5), torch.tensor([0, 1])
    with pytest.raises(exc, match="logit_scale"):
        fusedce.cross_entropy(x, t, logit_scale=bad)
    with pytest.raises(exc, match="logit_scale"):
        fusedce.CrossEntropyLoss(logit_scale=bad)


def test_use_token_scaling_must_be_a_bool():
    with pytest.raises(TypeError, match="use_token_scaling"):
        fusedce.cross_entropy(torch.randn(2, 5), torch.tensor([0, 1]), use_token_scaling=1)


@pytest.mark.parametrize("offset", [0.0, 1e3, 1e4])
def test_token_scaling_precise_at_large_logits(backend, offset):
    """p_t = exp((z_t - lse) - lse_lo) with lse's rounding error: the DFT loss and gradient stay as
    accurate as stock fp32's ``nll * exp(-nll).detach()`` when every logit is shifted by ``offset``
    (lse ~ offset: a single fp32 lse alone would cost |lse| 2^-24 on every p_t)."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    x = (offset + torch.randn(64, 50, dtype=torch.float64)).float()
    t = torch.randint(0, 50, (64,))

    def dft(logits):
        nll = F.cross_entropy(logits, t, reduction="none")
        return (nll * torch.exp(-nll).detach()).sum()

    x64 = x.double().requires_grad_()
    exact = dft(x64)
    exact.backward()
    x32 = x.clone().requires_grad_()
    stock = dft(x32)
    stock.backward()
    xf = x.clone().requires_grad_()
    ours = fusedce.cross_entropy(xf, t, reduction="sum", use_token_scaling=True, backend=backend)
    ours.backward()
    assert abs(float(ours) - float(exact)) <= 2 * abs(float(stock) - float(exact)) + 2.0 ** -22 * float(exact)
    err, stock_err = float((xf.grad.double() - x64.grad).norm()), float((x32.grad.double() - x64.grad).norm())
    assert err <= 2 * stock_err + 1e-12, (err, stock_err)
    h = torch.eye(50)[:, :50]           # identity head: the linear op sees the same logits
    hl = x.clone().requires_grad_()
    lin = fusedce.linear_cross_entropy(hl, h, t, reduction="sum", use_token_scaling=True, backend=backend)
    lin.backward(retain_graph=True)
    first = hl.grad.clone()
    lin.backward()                       # the recomputing second backward: the same p_t
    assert float((hl.grad - 2 * first).abs().max()) <= 2.0 ** -18 * float(first.abs().max())
