"""``fusedce.linear_cross_entropy``: every loss option alone and combined, every reduction, 2-D and 3-D
hidden, bias or not, frozen tensors, chunk sizes, index dtypes and strides, for both backends, against
the float64 ``F.linear`` + ``F.cross_entropy`` composition (reference64_linear.py; allocations poisoned).
fp32 throughout: the low-precision dtypes are test_linear_precision.py's."""
import pytest
import torch

import fusedce
from inputs import make_target, make_weight
from reference64_linear import check_linear, make_linear
from linear_options import OPTIONS, _upstream

# ---------------------------------------------------------------------------------------------------
# The option matrix: 13 tokens (odd: the last chunk of 4 is partial; with every 3rd ignored 9 rows
# remain = chunks of 4, 4, 1), H = 16, V = 1000 (not a power of two: a partial vocabulary block), with a
# bias. 13 x 1000 logits per Triton launch keeps the interpreter fast.
ROWS, HIDDEN, V, CHUNK = 13, 16, 1000, 4


def _case(name, lead=(ROWS,), n_classes=V, bias=True, index_dtype=torch.int64, requires_grad=(True,) * 3):
    opts, scale, ignore_every, with_weight = OPTIONS[name]
    hidden, weight, b = make_linear(lead, HIDDEN, n_classes, bias=bias, logit_scale=scale,
                                    requires_grad=requires_grad)
    target = make_target(lead, n_classes, index_dtype, ignore_every, opts.get("ignore_index", -100))
    ce_weight = make_weight(n_classes) if with_weight else None
    return hidden, weight, b, target, dict(opts, ce_weight=ce_weight)


@pytest.mark.parametrize("reduction", ["mean", "none"])   # "sum": test_shapes_bias_index_dtypes
@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_matrix(backend, name, reduction):
    hidden, weight, bias, target, opts = _case(name)
    check_linear(hidden, weight, target, bias, backend=backend, reduction=reduction, chunk_size=CHUNK,
                 upstream=_upstream(reduction, target.shape), **opts)


# ---------------------------------------------------------------------------------------------------
# Chunk sizes: 16 tokens as (2, 8); none ignored (16 rows: 4 divides, 5 does not) or every other one
# ignored (8 rows after compaction: 4 divides, 5 does not); 1 (one token per chunk), 100 (> BT: one
# chunk), None (automatic: min(BT, max(1024, BT H / V)) = all rows here). V = 300 keeps chunk_size=1's
# 8-16 interpreter launches short.
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("ignore_every", [0, 2], ids=["none_ignored", "half_ignored"])
@pytest.mark.parametrize("chunk_size", [1, 4, 5, 100, None], ids=lambda c: f"chunk{c}")
def test_chunk_sizes(backend, chunk_size, ignore_every, reduction):
    hidden, weight, bias = make_linear((2, 8), HIDDEN, 300, bias=True)
    target = make_target((2, 8), 300, ignore_every=ignore_every)
    check_linear(hidden, weight, target, bias, backend=backend, reduction=reduction, chunk_size=chunk_size,
                 upstream=_upstream(reduction, target.shape), lse_square_scale=1e-2, label_smoothing=0.1)


# ---------------------------------------------------------------------------------------------------
# Leading shapes (1-D tokens, (B, T), (B, T, K)), with and without bias; int64 targets for 2-D hidden,
# int32 for the others. V = 257 = 2^8 + 1.
LEADING = {"2d_hidden": ((10,), torch.int64), "3d_hidden": ((2, 5), torch.int32),
           "4d_hidden": ((2, 2, 3), torch.int32)}


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lead", list(LEADING))
def test_shapes_bias_index_dtypes(backend, lead, reduction, bias):
    shape, index_dtype = LEADING[lead]
    hidden, weight, b, target, opts = _case("ignore_-100", shape, 257, bias, index_dtype)
    _, out, loss, grads = check_linear(hidden, weight, target, b, backend=backend, reduction=reduction,
                                       chunk_size=3, upstream=_upstream(reduction, target.shape), **opts)
    assert set(grads) == {"grad_hidden", "grad_weight"} | ({"grad_bias"} if bias else set())


# ---------------------------------------------------------------------------------------------------
# Frozen tensors: only the gradients asked for are computed, and they are still right.
FROZEN = {"weight_frozen": (True, False, False), "hidden_frozen": (False, True, True),
          "bias_frozen": (True, True, False), "only_bias": (False, False, True)}


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("frozen", list(FROZEN))
def test_frozen_tensors(backend, frozen, reduction):
    hidden, weight, bias, target, opts = _case("smoothing_0.1", (3, 4), 300, True,
                                               requires_grad=FROZEN[frozen])
    _, _, _, grads = check_linear(hidden, weight, target, bias, backend=backend, reduction=reduction,
                                  chunk_size=5, upstream=_upstream(reduction, target.shape), **opts)
    wanted = {n for n, rg in zip(("grad_hidden", "grad_weight", "grad_bias"), FROZEN[frozen]) if rg}
    assert set(grads) == wanted
    for t in (hidden, weight, bias):
        assert t.grad is None     # autograd.grad was used: nothing accumulated into .grad


def test_backward_into_dot_grad(backend):
    """``loss.backward()`` (not autograd.grad) fills ``.grad`` of exactly the leaves that require it."""
    hidden, weight, bias, target, opts = _case("ignore_-100", (8,), 300, True, requires_grad=(True, False, True))
    loss = fusedce.linear_cross_entropy(hidden, weight, target, bias, backend=backend, chunk_size=3)
    loss.backward()
    assert hidden.grad is not None and bias.grad is not None and weight.grad is None
    assert hidden.grad.shape == hidden.shape and bias.grad.shape == bias.shape


# ---------------------------------------------------------------------------------------------------
# Strides: hidden a (B, T, H) view of a (T, B, H) tensor, weight the transpose of an (H, V) tensor (a
# tied-embedding layout), target every other element of a longer tensor whose other elements are out
# of range (reading through a wrong stride raises or gives NaN).
def test_strided_inputs(backend):
    n_classes = 300
    hidden_tbh = torch.randn(5, 2, HIDDEN, requires_grad=True)
    hidden = hidden_tbh.transpose(0, 1)
    weight_hv = (torch.randn(HIDDEN, n_classes) * 0.5).requires_grad_()
    weight = weight_hv.t()
    t_buf = make_target((20,), n_classes)
    t_buf[1::2] = n_classes + 7
    target = t_buf[::2].reshape(2, 5)
    target[0, 1] = -100
    assert not hidden.is_contiguous() and not weight.is_contiguous()
    for reduction in ("mean", "none"):
        check_linear(hidden, weight, target, backend=backend, reduction=reduction, chunk_size=3,
                     upstream=_upstream(reduction, target.shape), label_smoothing=0.1)


def test_first_and_last_class_targets(backend):
    """Every target the first or the last class (the vocabulary's edge blocks), V = 257."""
    hidden, weight, bias = make_linear((6,), HIDDEN, 257, bias=True)
    target = torch.tensor([0, 256, 0, 256, 256, 0])
    check_linear(hidden, weight, target, bias, backend=backend, reduction="none", upstream=torch.randn(6),
                 chunk_size=4, return_stats=True)
