"""return_stats=True: CrossEntropyOutput(loss, z_loss, lse, token_accuracy, predicted_tokens)."""
import pytest
import torch

import fusedce
from inputs import DTYPE_IDS, DTYPES, call, make_logits, make_target, make_weight, poisoned_allocations
from reference64 import reference_cross_entropy
from tolerances import FP32_UNITS, U32, assert_loss_close, assert_lse_close

ROWS, V = 14, 501


def _half_correct(x, t, ignore_index=-100):
    """Targets = the argmax on even rows (so accuracy is neither 0 nor 1), except ignored rows."""
    t = t.clone()
    am = x.detach().float().argmax(-1)
    keep = t == ignore_index
    t[..., ::2] = am[..., ::2].to(t.dtype)
    t[keep] = ignore_index
    return t


def test_output_type():
    assert issubclass(fusedce.CrossEntropyOutput, tuple)
    assert fusedce.CrossEntropyOutput._fields == ("loss", "z_loss", "lse", "token_accuracy", "predicted_tokens")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("options", ["plain", "zloss", "all"])
def test_stats_values(backend, options, dtype, reduction):
    shape = (2, ROWS // 2)
    kw = {"plain": {}, "zloss": {"lse_square_scale": 1e-2},
          "all": {"lse_square_scale": 1e-2, "label_smoothing": 0.1, "softcap": 30.0, "ignore_index": -1,
                  "num_items_in_batch": 9}}[options]
    x = make_logits((*shape, V), dtype, scale=3.0)
    t = _half_correct(x, make_target(shape, V, torch.int32, 3, kw.get("ignore_index", -100)),
                      kw.get("ignore_index", -100))
    w = make_weight(V) if options == "all" else None
    ref = reference_cross_entropy(x, t, w, reduction=reduction, with_grad=False, **kw)
    with poisoned_allocations():
        out = call(x, t, w, backend=backend, reduction=reduction, return_stats=True, **kw)
    assert isinstance(out, fusedce.CrossEntropyOutput)
    out_shape = shape if reduction == "none" else ()
    assert_loss_close(out.loss.detach(), ref, dtype)
    # z_loss: the fp32 s * lse^2 part; its error is 2 s |lse| times the lse error (u M per row)
    z_bound = FP32_UNITS * U32 * 2 * kw.get("lse_square_scale", 0.0) * (ref.lse.abs() * ref.row_mag)
    valid = (t != kw.get("ignore_index", -100)).double()
    z_bound = z_bound * valid.reshape(shape)
    if reduction != "none":
        z_bound = z_bound.sum() * (1.0 / ref.z_denominator if reduction == "mean" else 1.0)
    assert out.z_loss.dtype == torch.float32 and tuple(out.z_loss.shape) == out_shape
    assert bool(((out.z_loss.double() - ref.z_loss).abs() <= z_bound + 1e-300).all()), (out.z_loss, ref.z_loss)
    if kw.get("lse_square_scale", 0.0) == 0.0:
        assert bool((out.z_loss == 0).all())
    assert tuple(out.lse.shape) == shape
    assert_lse_close(out.lse, ref, dtype)
    assert out.predicted_tokens.dtype == torch.int64 and tuple(out.predicted_tokens.shape) == shape
    assert torch.equal(out.predicted_tokens, ref.predicted)
    assert out.token_accuracy.dtype == torch.float32 and tuple(out.token_accuracy.shape) == out_shape
    assert torch.allclose(out.token_accuracy.double(), ref.token_accuracy, rtol=0, atol=2 * U32)
    if reduction != "none":
        assert 0.0 < float(out.token_accuracy) < 1.0, "premise: targets half right"


def test_stats_loss_equals_plain_loss(backend):
    x = make_logits((ROWS, V), torch.bfloat16)
    t = make_target((ROWS,), V, ignore_every=3)
    kw = dict(label_smoothing=0.1, lse_square_scale=1e-2, softcap=20.0)
    plain = call(x, t, backend=backend, **kw)
    out = call(x, t, backend=backend, return_stats=True, **kw)
    ref = reference_cross_entropy(x, t, with_grad=False, **kw)
    assert_loss_close(plain.detach(), ref, torch.bfloat16)
    assert_loss_close(out.loss.detach(), ref, torch.bfloat16)


def test_only_loss_carries_gradient(backend):
    x = make_logits((ROWS, V), torch.float32)
    t = make_target((ROWS,), V, ignore_every=3)
    out = call(x, t, backend=backend, return_stats=True, lse_square_scale=1e-2)
    assert out.loss.requires_grad
    for name in ("z_loss", "lse", "token_accuracy", "predicted_tokens"):
        assert not getattr(out, name).requires_grad, f"{name} must not carry a gradient"
    ref = reference_cross_entropy(x, t, lse_square_scale=1e-2)
    (grad,) = torch.autograd.grad(out.loss, x)
    from tolerances import assert_grad_close
    assert_grad_close(grad, ref, torch.float32)


def test_lse_on_ignored_rows_and_softcap(backend):
    """lse is of the softcapped logits on counted rows and exactly 0 on ignored rows (never computed;
    the same rule as linear_cross_entropy's stats)."""
    x = make_logits((ROWS, V), torch.float32, scale=40.0)
    t = torch.full((ROWS,), -100)
    t[0], t[3] = 3, V - 1
    out = call(x, t, backend=backend, return_stats=True, softcap=30.0)
    ref = reference_cross_entropy(x, t, softcap=30.0, with_grad=False)
    assert_lse_close(out.lse, ref, torch.float32)
    ignored = t == -100
    assert bool((out.lse[ignored] == 0).all()), out.lse[ignored]
    uncapped = torch.logsumexp(x.detach().double(), -1)
    assert bool(((out.lse.double() - uncapped).abs()[~ignored] > 1.0).all()), "premise: the softcap changes lse"


def test_argmax_ties_lowest_index(backend):
    """Ties in the row maximum: predicted is the lowest index (bf16 makes exact ties easy)."""
    x = make_logits((6, V), torch.bfloat16, requires_grad=False)
    top = x.max() + 1
    cols = [(5, 17), (0, V - 1), (300, 301), (V - 2, V - 1), (40, 499), (2, 3)]
    for r, (a, b) in enumerate(cols):
        x[r, b] = top          # the later one written first ...
        x[r, a] = top          # ... so "last written" and "lowest index" disagree
    t = torch.tensor([c[1] for c in cols])  # targets = the higher index: accuracy must be 0
    out = call(x, t, backend=backend, return_stats=True, reduction="none")
    assert out.predicted_tokens.tolist() == [c[0] for c in cols]
    assert bool((out.token_accuracy == 0).all())


def test_accuracy_per_row_and_predicted_on_ignored(backend):
    x = make_logits((ROWS, V), torch.float32)
    t = _half_correct(x, make_target((ROWS,), V, ignore_every=3))
    out = call(x, t, backend=backend, return_stats=True, reduction="none")
    ignored = t == -100
    correct = (~ignored) & (x.detach().argmax(-1) == t)
    assert torch.equal(out.token_accuracy, correct.float())
    assert bool((out.predicted_tokens[ignored] == -1).all())
    assert torch.equal(out.predicted_tokens[~ignored], x.detach().argmax(-1)[~ignored])
    mean = call(x, t, backend=backend, return_stats=True)
    assert abs(float(mean.token_accuracy) - float(correct.sum()) / float((~ignored).sum())) <= 2 * U32
    sum_ = call(x, t, backend=backend, return_stats=True, reduction="sum")
    assert float(sum_.token_accuracy) == float(mean.token_accuracy), "accuracy is a fraction for sum too"
