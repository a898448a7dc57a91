"""Special values in the logits: NaN (that row's loss is NaN, never silently 0, and nothing leaks into
other rows), -inf masks (whole vocabulary blocks masked: the online softmax must not compute
exp(-inf - -inf)), huge magnitudes (overflow without the max shift) and constant rows."""
import math

import pytest
import torch

from inputs import DTYPE_IDS, call, check_against_reference, make_logits, make_target
from reference64 import reference_cross_entropy
from tolerances import assert_grad_close, assert_loss_close

ROWS, V = 6, 1000
NAN_ROW = 2


def _nan_column(where, target):
    return {"target_col": int(target[NAN_ROW]), "first_col": 0, "last_col": V - 1, "middle_col": 517}[where]


@pytest.mark.parametrize("options", ["plain", "smoothing", "softcap_zloss"])
@pytest.mark.parametrize("where", ["target_col", "first_col", "last_col", "middle_col"])
def test_nan_row(backend, where, options):
    kw = {"plain": {}, "smoothing": {"label_smoothing": 0.1},
          "softcap_zloss": {"softcap": 20.0, "lse_square_scale": 1e-2}}[options]
    x = make_logits((ROWS, V), torch.float32, requires_grad=False)
    t = make_target((ROWS,), V)
    t[NAN_ROW] = 123
    x[NAN_ROW, _nan_column(where, t)] = float("nan")
    x.requires_grad_(True)
    others = torch.tensor([r for r in range(ROWS) if r != NAN_ROW])
    ref = reference_cross_entropy(x[others], t[others], reduction="none", **kw)
    loss = call(x, t, backend=backend, reduction="none", **kw)
    assert torch.isnan(loss[NAN_ROW]), f"NaN in row {NAN_ROW}'s logits must give a NaN loss, got {loss[NAN_ROW]}"
    assert_loss_close(loss.detach()[others], ref, torch.float32)
    (grad,) = torch.autograd.grad(loss, x, torch.ones(ROWS))
    assert_grad_close(grad[others], ref, torch.float32)
    mean = call(x, t, backend=backend, **kw)
    assert torch.isnan(mean), "the mean over a NaN row is NaN"


def test_nan_in_ignored_row_does_not_leak(backend):
    """An ignored row is never read for the loss: NaN there must not reach the other rows or the mean."""
    x = make_logits((ROWS, V), torch.float32, requires_grad=False)
    x[NAN_ROW, 10] = float("nan")
    x.requires_grad_(True)
    t = make_target((ROWS,), V)
    t[NAN_ROW] = -100
    keep = torch.tensor([r for r in range(ROWS) if r != NAN_ROW])
    loss = call(x, t, backend=backend)
    ref = reference_cross_entropy(x[keep], t[keep], num_items_in_batch=ROWS - 1)
    assert_loss_close(loss.detach(), ref, torch.float32)
    (grad,) = torch.autograd.grad(loss, x)
    assert_grad_close(grad[keep], ref, torch.float32)
    assert bool((grad[NAN_ROW] == 0).all()), "ignored rows get exactly zero gradient"


@pytest.mark.parametrize("options", ["plain", "weight_zloss", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_minus_inf_masked_blocks(backend, dtype, options):
    """-inf over whole blocks (columns 0..4095 of row 0: the first block of any BLOCK_V <= 4096), every
    other column of row 1, all but the target in row 2. Loss and gradient stay finite and exact."""
    n_classes = 5000
    x = make_logits((4, n_classes), dtype, requires_grad=False)
    t = torch.tensor([4500, 2, 7, 4999])
    x[0, :4096] = float("-inf")
    x[1, 1::2] = float("-inf")
    x[2, :] = float("-inf")
    x[2, 7] = 1.5
    x.requires_grad_(True)
    kw = {"plain": {}, "weight_zloss": {"lse_square_scale": 1e-2}, "softcap": {"softcap": 15.0}}[options]
    w = torch.rand(n_classes) + 0.5 if options == "weight_zloss" else None
    ref, loss, grad = check_against_reference(x, t, w, backend=backend, reduction="none",
                                              upstream=torch.randn(4), **kw)
    assert bool(torch.isfinite(loss).all()) and bool(torch.isfinite(grad).all())


@pytest.mark.parametrize("offset", [1e4, -1e4], ids=["plus_1e4", "minus_1e4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
def test_huge_logits(backend, dtype, offset):
    """Logits around +-1e4: exp overflows / underflows without the max shift (fp32 exp overflows at 88)."""
    x = (make_logits((5, V), torch.float32, requires_grad=False) * 4 + offset).to(dtype).requires_grad_()
    t = make_target((5,), V, ignore_every=4)
    check_against_reference(x, t, backend=backend, reduction="mean", lse_square_scale=1e-6)


def test_constant_rows(backend):
    """A constant row: p = 1/V everywhere, loss = log V, every column ties (argmax -> index 0)."""
    x = torch.full((3, V), 2.5, requires_grad=True)
    t = torch.tensor([0, 499, V - 1])
    ref, loss, _ = check_against_reference(x, t, backend=backend, reduction="none")
    assert torch.allclose(ref.loss, torch.full((3,), math.log(V), dtype=torch.float64)), "premise"
    out = call(x, t, backend=backend, return_stats=True, reduction="none")
    assert out.predicted_tokens.tolist() == [0, 0, 0]
    assert out.token_accuracy.tolist() == [1.0, 0.0, 0.0]
