"""The cases of /work/shared/cases/README.md that apply to ``cross_entropy`` (C1-C4, C6-C8, C12), for
both backends. C5, C9 and C10 are linear / vocab-parallel cases; C11 needs a GPU (> 2^31 elements).
Shapes are the case's own unless noted: C6 and C12 keep the case's V and dtype but use 16 / 8 rows
instead of 64 / 4096 (the fault is per element, not per row count; the Triton interpreter runs on CPU
and costs per row x vocabulary block)."""
import pytest
import torch
import torch.nn.functional as F

from inputs import (bit_identical, call, check_against_reference, make_logits, make_target, make_weight,
                    poisoned_allocations)
from reference64 import reference_cross_entropy
from tolerances import FP32_UNITS, TORCH_LOW_PRECISION_FACTOR, U32, assert_grad_close, assert_loss_close


def test_c1_mean_denominator_in_the_gradient(backend):
    """C1: (64, 5000) fp32, every 3rd row ignored, mean: grad scaled by 1/n_valid, not 1/n_rows."""
    x = make_logits((64, 5000), torch.float32, scale=1.0)
    t = torch.randint(0, 5000, (64,))
    t[::3] = -100
    ref, _, grad = check_against_reference(x, t, backend=backend, reduction="mean")
    ratio = float(grad.double().norm() / ref.grad.norm())
    assert abs(ratio - 1.0) < 1e-5, f"grad norm is {ratio:.4f}x the reference (1/n_rows scaling gives 0.656x)"


def test_c2_all_ignored_no_nan(backend):
    """C2: (16, 1000), every target -100, mean: loss 0.0, grad all 0, no NaN (torch gives NaN)."""
    x = make_logits((16, 1000), torch.float32)
    t = torch.full((16,), -100)
    with poisoned_allocations():
        loss = call(x, t, backend=backend, reduction="mean")
        (grad,) = torch.autograd.grad(loss, x)
    assert float(loss.detach()) == 0.0 and not bool(torch.isnan(loss).any())
    assert bool((grad == 0).all())
    assert torch.isnan(F.cross_entropy(x.detach(), t)), "premise: torch's own mean is NaN here"


@pytest.mark.parametrize("variant", ["p_times_5", "p_itself"])
def test_c3_saved_tensors_not_corrupted(backend, variant):
    """C3: p = softmax(a); loss = CE(p * 5, t) + (p ** 2).sum(). softmax and pow saved p (and p * 5 is an
    input the CE may save): with the default inplace_backward=False nothing may be overwritten.
    "p_itself" passes p directly, the tensor softmax's backward reads."""
    a = torch.randn(8, 300, requires_grad=True)
    t = make_target((8,), 300, ignore_every=3)
    factor = 5.0 if variant == "p_times_5" else 1.0

    def composed(ce, a_):
        p = torch.softmax(a_, dim=-1)
        return ce(p * factor if factor != 1.0 else p, t) + (p ** 2).sum()

    (grad,) = torch.autograd.grad(composed(lambda z, tt: call(z, tt, backend=backend), a), a)
    a64 = a.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(composed(lambda z, tt: F.cross_entropy(z, tt), a64), a64)
    a32 = a.detach().clone().requires_grad_()
    (stock,) = torch.autograd.grad(composed(lambda z, tt: F.cross_entropy(z, tt), a32), a32)
    err, stock_err = float((grad.double() - ref).abs().max()), float((stock.double() - ref).abs().max())
    # no worse than torch's own fp32 composition (x4), plus the table's fp32 units on the largest term
    assert err <= 4.0 * stock_err + FP32_UNITS * U32 * float(ref.abs().max()), (err, stock_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("options", ["plain", "all"])
def test_c4_forward_does_not_mutate(backend, dtype, options):
    """C4: forward only (no_grad), (8, 300), some rows ignored: logits bit-identical afterwards."""
    x = make_logits((8, 300), dtype, requires_grad=False)
    t = make_target((8,), 300, ignore_every=3)
    w = make_weight(300)
    before = [x.clone(), t.clone(), w.clone()]
    kw = {} if options == "plain" else dict(label_smoothing=0.1, lse_square_scale=1e-2, softcap=5.0,
                                             return_stats=True, reduction="none")
    with torch.no_grad():
        call(x, t, w if options == "all" else None, backend=backend, **kw)
    for b, a in zip(before, (x, t, w)):
        assert bit_identical(a, b)


@pytest.mark.parametrize("offset", [50.0, 20.0], ids=["p_t_is_1_in_fp32", "one_minus_p_t_1e-4"])
def test_c6_cancellation_at_the_target(backend, offset):
    """C6: bf16 (16 here, 64 in the case, 32000) randn, logit[i, t_i] += offset, mean. At the target column the
    gradient is (p_t - 1) / n: its error vs float64 must be no worse than 4x torch's own bf16 F.cross_entropy error.
    offset 50: 1 - p_t ~ 1e-17 (rounds away in fp32); 20: 1 - p_t ~ 1e-4, below bf16's 2^-8 near 1."""
    rows, n_classes = 16, 32000
    base = torch.randn(rows, n_classes)
    t = torch.randint(0, n_classes, (rows,))
    base[torch.arange(rows), t] += offset
    x = base.to(torch.bfloat16).requires_grad_()
    ref = reference_cross_entropy(x, t, reduction="mean")
    loss = call(x, t, backend=backend)
    (grad,) = torch.autograd.grad(loss, x)
    xs = x.detach().clone().requires_grad_()
    (stock,) = torch.autograd.grad(F.cross_entropy(xs, t), xs)
    assert grad.dtype == torch.bfloat16
    at = (torch.arange(rows), t)
    # With offset 50 float64 itself rounds p_t to 1, so torch's error can be exactly 0; the floor is the
    # table's fp32 allowance (64 u K M / n ~ 1.2e-5 here: M ~ 51), 20x below the fault's size (a bf16 ulp
    # of 1, / n: 2^-8 / 16 = 2.4e-4), so the fault is still caught.
    floor = FP32_UNITS * U32 * float(ref.grad_err_scale.max())
    err = float((grad[at].double() - ref.grad[at]).abs().max())
    stock_err = float((stock[at].double() - ref.grad[at]).abs().max())
    assert err <= TORCH_LOW_PRECISION_FACTOR * stock_err + floor, (
        f"target-column grad error {err:.3e} > {TORCH_LOW_PRECISION_FACTOR} x torch bf16's {stock_err:.3e}"
        f" + {floor:.1e}")
    err_all = float((grad.double() - ref.grad).abs().max())
    stock_all = float((stock.double() - ref.grad).abs().max())
    assert err_all <= TORCH_LOW_PRECISION_FACTOR * stock_all + floor, (err_all, stock_all, floor)
    assert floor < 2.0 ** -8 / rows / 10, "premise: the floor stays far below the fault it guards"
    assert_loss_close(loss.detach(), ref, torch.bfloat16)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_c7_weight_never_read_at_ignore_index(backend, reduction):
    """C7: class weights, ignore_index=-100, some rows ignored. weight and logits are windows of
    NaN-filled buffers, so reading weight[-100] (or logits[row, -100] of the first row) returns NaN;
    weight[V - 100] is huge, so a wrapped-around index -100 -> V - 100 changes the loss."""
    n_classes, rows = 300, 9
    w_buf = torch.full((n_classes + 200,), float("nan"))
    w = w_buf[100:100 + n_classes]
    w.copy_(make_weight(n_classes))
    w[n_classes - 100] = 1e6
    x_buf = torch.full((rows + 2, n_classes), float("nan"))
    x_buf[1:1 + rows] = make_logits((rows, n_classes), torch.float32, requires_grad=False)
    x_buf.requires_grad_(True)
    x = x_buf[1:1 + rows]
    t = make_target((rows,), n_classes, ignore_every=0)
    t[t == n_classes - 100] = 0  # keep the huge weight off every real target
    t[0], t[4], t[8] = -100, -100, -100
    up = torch.randn(rows) if reduction == "none" else None
    check_against_reference(x, t, w, backend=backend, reduction=reduction, upstream=up)


@pytest.mark.parametrize("bad", ["V", "-1"])
def test_c8_unchecked_gather(backend, bad):
    """C8: target = V (or -1 with ignore_index=-100) in one row: IndexError naming the position, the
    value and V; nothing of the caller's modified."""
    n_classes = 300
    x = make_logits((8, n_classes), torch.float32)
    t = make_target((8,), n_classes, ignore_every=3)
    value = n_classes if bad == "V" else -1
    t[5] = value
    before = (x.detach().clone(), t.clone())
    with pytest.raises(IndexError) as info:
        call(x, t, backend=backend, inplace_backward=True)
    msg = str(info.value)
    assert "5" in msg and str(value) in msg and str(n_classes) in msg, msg
    assert bit_identical(x.detach(), before[0]) and bit_identical(t, before[1])


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_c12_softcap_bf16(backend, reduction):
    """C12: softcap=30.0, bf16, V = 32000 (8 rows): equals the reference of 30*tanh(x/30) in float64.
    Logits ~ 40 * randn so tanh saturates and the chain-rule factor 1 - (z/30)^2 matters."""
    x = make_logits((8, 32000), torch.bfloat16, scale=40.0)
    t = make_target((8,), 32000, ignore_every=5)
    up = torch.randn(8) if reduction == "none" else None
    check_against_reference(x, t, backend=backend, reduction=reduction, upstream=up, softcap=30.0)


def _compiled(backend, fullgraph=False):
    # aot_eager: Dynamo + AOTAutograd trace the whole call (the part C12 is about: graph capture, scalar
    # dtypes, the autograd Function) without Inductor's C++ build, which takes ~30 s per process on CPU.
    def f(x, t):
        return call(x, t, backend=backend, reduction="none", softcap=30.0)
    torch._dynamo.reset()
    return torch.compile(f, backend="aot_eager", fullgraph=fullgraph)


def test_c12_softcap_under_torch_compile(backend):
    """C12 under torch.compile: same values as the reference, float32 loss, gradient flows."""
    x = make_logits((4, 32000), torch.bfloat16, scale=40.0)
    t = make_target((4,), 32000, ignore_every=3)
    up = torch.randn(4)
    ref = reference_cross_entropy(x, t, reduction="none", softcap=30.0, upstream=up)
    loss = _compiled(backend)(x, t)
    assert loss.dtype == torch.float32
    assert_loss_close(loss.detach(), ref, torch.bfloat16)
    (grad,) = torch.autograd.grad(loss, x, up)
    assert_grad_close(grad, ref, torch.bfloat16)


def test_bad_target_under_torch_compile_is_nan_row(backend):
    """Under torch.compile the range check (a host sync) is skipped: the bad row's loss is NaN, the
    others are right, and nothing is read out of bounds."""
    x = make_logits((4, 1000), torch.float32, scale=40.0)
    t = make_target((4,), 1000)
    keep = torch.tensor([0, 1, 3])
    ref = reference_cross_entropy(x[keep], t[keep], reduction="none", softcap=30.0, with_grad=False)
    t_bad = t.clone()
    t_bad[2] = 1000
    loss = _compiled(backend)(x, t_bad).detach()
    assert torch.isnan(loss[2]), f"row 2 has target V: its loss must be NaN, got {float(loss[2])}"
    assert_loss_close(loss[keep], ref, torch.float32)


def test_c12_compiles_without_graph_break(backend):
    """fullgraph=True: the call traces as one graph (backends/triton/cross_entropy.py documents this; a graph
    break would also split the softcap math from the kernels)."""
    x = make_logits((4, 300), torch.float32, scale=40.0)
    t = make_target((4,), 300, ignore_every=3)
    ref = reference_cross_entropy(x, t, reduction="none", softcap=30.0)
    loss = _compiled(backend, fullgraph=True)(x, t)
    assert_loss_close(loss.detach(), ref, torch.float32)
    (grad,) = torch.autograd.grad(loss, x, torch.ones(4))
    assert_grad_close(grad, ref, torch.float32)
