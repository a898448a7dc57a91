"""Reductions and gradients: upstream gradients of every kind, the mean denominator
(num_items_in_batch, D == 0), all-ignored and empty input, inplace_backward's aliasing and its absence,
repeated backward, and the nn.Module wrapper."""
import inspect

import pytest
import torch

import fusedce
from inputs import (DTYPE_IDS, DTYPES, bit_identical, call, check_against_reference, make_logits,
                    make_target, make_weight, poisoned_allocations)
from reference64 import reference_cross_entropy
from tolerances import assert_grad_close, assert_loss_close

ROWS, V = 12, 777  # 777: odd, not near a power of two


# ---------------------------------------------------------------------------------------------------
# Upstream gradients. "mean"/"sum": unit, scalar and negative scalar. "none": random per token,
# stride-0 (loss.sum() / loss.mean() hand an expanded scalar), non-contiguous, and 2-D transposed.
@pytest.mark.parametrize("upstream", [None, 3.7, -0.5], ids=["unit", "x3.7", "x-0.5"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_scalar_upstream(backend, dtype, reduction, upstream):
    x = make_logits((ROWS, V), dtype)
    t = make_target((ROWS,), V, ignore_every=3)
    check_against_reference(x, t, backend=backend, reduction=reduction, upstream=upstream,
                            label_smoothing=0.1, lse_square_scale=1e-2)


def _upstreams(shape):
    n = 1
    for s in shape:
        n *= s
    return {
        "random": torch.randn(shape),
        "sum_stride0": torch.ones(()).expand(shape),           # what loss.sum().backward() hands down
        "mean_stride0": torch.full((), 1.0 / n).expand(shape),  # loss.mean()
        "noncontiguous": torch.randn(2 * n)[::2].reshape(shape) if len(shape) == 1 else torch.randn(*shape[::-1]).t(),
        "with_zeros": torch.randn(shape) * (torch.rand(shape) > 0.5),
    }


@pytest.mark.parametrize("kind", ["random", "sum_stride0", "mean_stride0", "noncontiguous", "with_zeros"])
@pytest.mark.parametrize("shape", [(ROWS,), (3, 4)], ids=["1d", "2d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_per_token_upstream(backend, dtype, shape, kind):
    up = _upstreams(shape)[kind]
    if kind == "noncontiguous":
        assert not up.is_contiguous()
    if kind.endswith("stride0"):
        assert up.stride() == (0,) * len(shape)
    x = make_logits((*shape, V), dtype)
    t = make_target(shape, V, ignore_every=3)
    check_against_reference(x, t, make_weight(V), backend=backend, reduction="none", upstream=up,
                            label_smoothing=0.1, softcap=10.0)


@pytest.mark.parametrize("how", ["sum", "mean", "weighted_sum"])
def test_none_reduction_composed_by_caller(backend, how):
    """The usual way "none" is used: the caller reduces; autograd hands an expanded (stride-0) grad."""
    x = make_logits((ROWS, V), torch.float32)
    t = make_target((ROWS,), V, ignore_every=3)
    scale = torch.randn(ROWS)
    reducers = {"sum": (lambda r: r.sum(), torch.ones(ROWS)),
                "mean": (lambda r: r.mean(), torch.full((ROWS,), 1.0 / ROWS)),
                "weighted_sum": (lambda r: (r * scale).sum(), scale)}
    reduce, per_token = reducers[how]
    ref = reference_cross_entropy(x, t, reduction="none", upstream=per_token)
    (grad,) = torch.autograd.grad(reduce(call(x, t, backend=backend, reduction="none")), x)
    assert_grad_close(grad, ref, torch.float32)


# ---------------------------------------------------------------------------------------------------
# The mean denominator.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)  # D is dtype-free
@pytest.mark.parametrize("num_items", [37, torch.tensor(37), torch.tensor(37.0), torch.tensor(5, dtype=torch.int32)],
                         ids=["int", "tensor_i64", "tensor_f32", "tensor_i32"])
@pytest.mark.parametrize("with_weight", [False, True], ids=["no_weight", "weight"])
def test_num_items_in_batch(backend, with_weight, num_items, dtype):
    """D = num_items_in_batch replaces the count (and the weight sum): loss = sum / D, grad / D too."""
    x = make_logits((ROWS, V), dtype)
    t = make_target((ROWS,), V, ignore_every=3)
    w = make_weight(V) if with_weight else None
    ref, loss, _ = check_against_reference(x, t, w, backend=backend, reduction="mean",
                                           num_items_in_batch=num_items, upstream=2.0)
    total = reference_cross_entropy(x, t, w, reduction="sum", with_grad=False).loss
    assert abs(float(ref.loss) - float(total) / float(num_items)) <= 1e-12 * abs(float(total))
    assert loss.shape == ()


@pytest.mark.parametrize("num_items", [0, torch.tensor(0)], ids=["int0", "tensor0"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_num_items_zero(backend, dtype, num_items):
    """D == 0 (contract): loss 0.0 and an all-zero gradient, not NaN (torch's x/0)."""
    x = make_logits((ROWS, V), dtype)
    t = make_target((ROWS,), V, ignore_every=3)
    with poisoned_allocations():
        out = call(x, t, backend=backend, num_items_in_batch=num_items, return_stats=True,
                   lse_square_scale=1e-2)
        (grad,) = torch.autograd.grad(out.loss * 5.0, x)
    assert out.loss.dtype == torch.float32 and float(out.loss.detach()) == 0.0
    assert float(out.z_loss) == 0.0
    assert bool((grad == 0).all()), "D == 0: the gradient must be all zeros"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("with_weight", [False, True], ids=["no_weight", "weight"])
def test_all_ignored(backend, with_weight, dtype, reduction):
    """Every target ignored: loss 0.0 (torch's mean gives NaN), gradient zeros, no NaN anywhere."""
    x = make_logits((ROWS, V), dtype)
    t = torch.full((ROWS,), -100)
    w = make_weight(V) if with_weight else None
    with poisoned_allocations():
        out = call(x, t, w, backend=backend, reduction=reduction, return_stats=True, label_smoothing=0.1,
                   lse_square_scale=1e-2)
        up = torch.randn(ROWS) if reduction == "none" else torch.tensor(1.5)
        (grad,) = torch.autograd.grad(out.loss, x, up)
    assert out.loss.dtype == torch.float32
    assert bool((out.loss == 0).all()) and tuple(out.loss.shape) == ((ROWS,) if reduction == "none" else ())
    assert bool((out.z_loss == 0).all())
    assert bool((grad == 0).all()) and grad.dtype == dtype
    assert bool((out.predicted_tokens == -1).all())
    assert bool((out.token_accuracy == 0).all()) and not bool(torch.isnan(out.token_accuracy).any())
    assert not bool(torch.isnan(out.lse).any())


EMPTY_SHAPES = {"0_rows": (0,), "3d_empty_time": (2, 0)}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lead", list(EMPTY_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_empty_input(backend, dtype, lead, reduction):
    """BT = 0: mean and sum give 0.0, none an empty tensor; backward gives an empty gradient."""
    shape = EMPTY_SHAPES[lead]
    x = make_logits((*shape, V), dtype)
    t = torch.zeros(shape, dtype=torch.int64)
    out = call(x, t, make_weight(V), backend=backend, reduction=reduction, return_stats=True,
               label_smoothing=0.1)
    assert out.loss.dtype == torch.float32
    if reduction == "none":
        assert tuple(out.loss.shape) == shape
    else:
        assert out.loss.shape == () and float(out.loss.detach()) == 0.0
        assert float(out.token_accuracy) == 0.0
    assert tuple(out.lse.shape) == shape and tuple(out.predicted_tokens.shape) == shape
    (grad,) = torch.autograd.grad(out.loss.sum(), x)
    assert grad.shape == x.shape and grad.dtype == dtype


# ---------------------------------------------------------------------------------------------------
# inplace_backward.
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_inplace_backward_aliases_logits(backend, dtype, reduction):
    """The gradient autograd hands to logits IS the logits' storage, holding the right values; rows that
    are ignored (random logits there) must have been overwritten with exact zeros."""
    x = make_logits((3, 4, V), dtype)
    t = make_target((3, 4), V, ignore_every=3)
    up = torch.randn(3, 4) if reduction == "none" else 0.75
    ref = reference_cross_entropy(x, t, reduction=reduction, upstream=up, softcap=20.0)
    loss = call(x, t, backend=backend, reduction=reduction, softcap=20.0, inplace_backward=True)
    assert_loss_close(loss, ref, dtype)
    (grad,) = torch.autograd.grad(loss, x, torch.as_tensor(up, dtype=torch.float32).expand_as(loss))
    assert grad.data_ptr() == x.data_ptr(), "inplace_backward=True: grad must be written into logits"
    assert bit_identical(x.detach(), grad)
    assert_grad_close(grad, ref, dtype)
    assert bool((grad[t == -100] == 0).all())


def test_inplace_backward_leaf_grad(backend):
    """.backward() on a leaf: x.grad ends up in x's own storage (one BT x V buffer saved)."""
    x = make_logits((ROWS, V), torch.float32)
    t = make_target((ROWS,), V, ignore_every=3)
    ref = reference_cross_entropy(x, t)
    call(x, t, backend=backend, inplace_backward=True).backward()
    assert x.grad is not None and x.grad.data_ptr() == x.data_ptr()
    assert_grad_close(x.grad, ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_inplace_backward_forward_leaves_logits(backend, dtype):
    """The contract destroys logits in *backward*; the forward alone must not touch them."""
    x = make_logits((ROWS, V), dtype)
    before = x.detach().clone()
    t = make_target((ROWS,), V, ignore_every=3)
    call(x, t, backend=backend, inplace_backward=True, return_stats=True)
    assert bit_identical(x.detach(), before)
    with torch.no_grad():
        call(x, t, backend=backend, inplace_backward=True)
    assert bit_identical(x.detach(), before)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_default_never_modifies_inputs(backend, dtype, reduction):
    """inplace_backward=False: logits, target and weight bit-identical after forward AND backward."""
    x = make_logits((ROWS, V), dtype)
    t = make_target((ROWS,), V, torch.int32, ignore_every=3)
    w = make_weight(V)
    saved = [x.detach().clone(), t.clone(), w.clone()]
    loss = call(x, t, w, backend=backend, reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-2,
                softcap=5.0, return_stats=True).loss
    loss.sum().backward()
    for before, after in zip(saved, (x.detach(), t, w)):
        assert bit_identical(after, before)


def test_backward_twice_with_retain_graph(backend):
    """Saved tensors survive the first backward (inplace_backward=False): the second gives the same grad."""
    x = make_logits((ROWS, V), torch.float32)
    t = make_target((ROWS,), V, ignore_every=3)
    loss = call(x, t, backend=backend, lse_square_scale=1e-2)
    (g1,) = torch.autograd.grad(loss, x, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, x)
    assert bit_identical(g1, g2)


def test_logits_without_grad(backend):
    """No requires_grad: the loss has no grad_fn and equals the reference."""
    x = make_logits((ROWS, V), torch.float32, requires_grad=False)
    t = make_target((ROWS,), V, ignore_every=3)
    loss = call(x, t, backend=backend)
    assert not loss.requires_grad
    assert_loss_close(loss, reference_cross_entropy(x, t, with_grad=False), torch.float32)


# ---------------------------------------------------------------------------------------------------
# The module.
def test_module_signature_order():
    """Argument order of the contract: data, target, optional tensors, then options."""
    params = list(inspect.signature(fusedce.CrossEntropyLoss.__init__).parameters)[1:]
    assert params == ["weight", "ignore_index", "reduction", "label_smoothing", "lse_square_scale", "softcap",
                      "inplace_backward", "return_stats", "backend", "batch_invariant",   # issue 29
                      "logit_scale", "use_token_scaling"]   # added by the one-path redesign, after the rest
    assert list(inspect.signature(fusedce.CrossEntropyLoss.forward).parameters)[1:] == [
        "logits", "target", "num_items_in_batch", "token_weights"]   # token_weights keyword-only
    sig = inspect.signature(fusedce.cross_entropy)
    assert list(sig.parameters)[:3] == ["logits", "target", "weight"]
    # keyword-only: their order is not part of a call (the loss options come last, from LossOptions)
    keyword_only = [n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert sorted(keyword_only) == sorted(["ignore_index", "reduction", "label_smoothing", "lse_square_scale",
                                           "softcap", "logit_scale", "use_token_scaling",
                                           "num_items_in_batch", "inplace_backward", "return_stats", "backend",
                                           "token_weights", "batch_invariant"])
    assert len(sig.parameters) == 3 + len(keyword_only)
    defaults = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    assert defaults == {"weight": None, "ignore_index": -100, "reduction": "mean", "label_smoothing": 0.0,
                        "lse_square_scale": 0.0, "softcap": None, "logit_scale": 1.0,
                        "use_token_scaling": False, "num_items_in_batch": None,
                        "inplace_backward": False, "return_stats": False, "backend": None, "token_weights": None,
                        "batch_invariant": False}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_module_matches_reference(backend, reduction):
    w = make_weight(V)
    module = fusedce.CrossEntropyLoss(w, -1, reduction, 0.1, 1e-2, 30.0, backend=backend)
    assert any(b is w for b in module.buffers()), "weight is registered as a buffer"
    assert "weight" in module.state_dict()
    x = make_logits((2, 6, V), torch.bfloat16, scale=40.0)
    t = make_target((2, 6), V, ignore_every=3, ignore_index=-1)
    up = torch.randn(2, 6) if reduction == "none" else 1.0
    ref = reference_cross_entropy(x, t, w, ignore_index=-1, reduction=reduction, label_smoothing=0.1,
                                  lse_square_scale=1e-2, softcap=30.0, num_items_in_batch=17, upstream=up)
    loss = module(x, t, num_items_in_batch=17)
    assert_loss_close(loss, ref, torch.bfloat16)
    (grad,) = torch.autograd.grad(loss, x, torch.as_tensor(up, dtype=torch.float32).expand_as(loss))
    assert_grad_close(grad, ref, torch.bfloat16)


def test_module_options_forwarded(backend):
    """inplace_backward and return_stats set on the module reach the function."""
    module = fusedce.CrossEntropyLoss(inplace_backward=True, return_stats=True, backend=backend)
    x = make_logits((ROWS, V), torch.float32)
    t = make_target((ROWS,), V, ignore_every=3)
    ref = reference_cross_entropy(x, t)
    out = module(x, t)
    assert isinstance(out, fusedce.CrossEntropyOutput)
    (grad,) = torch.autograd.grad(out.loss, x)
    assert grad.data_ptr() == x.data_ptr()
    assert_grad_close(grad, ref, torch.float32)
