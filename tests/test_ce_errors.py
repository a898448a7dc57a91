"""Every error of the contract, raised before anything is written: the caller's tensors are unchanged
afterwards (inplace_backward=True is passed so that an early write would have a place to land)."""
import re

import pytest
import torch

from inputs import bit_identical, call, make_logits, make_target, make_weight

ROWS, V = 10, 37  # V = 37: a small prime, so V appears in messages unambiguously


def _raises(exc, backend, logits, target, weight=None, match=None, **kw):
    """Call, expect ``exc``; then check that logits, target and weight are bit-identical."""
    saved = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in (logits, target, weight)]
    with pytest.raises(exc, match=match) as info:
        call(logits, target, weight, backend=backend, inplace_backward=True, **kw)
    for before, after in zip(saved, (logits, target, weight)):
        if isinstance(before, torch.Tensor) and before.device.type != "meta":
            assert bit_identical(after.detach(), before), "an argument was modified before the error"
    return str(info.value)


def _good():
    return make_logits((ROWS, V), torch.float32), make_target((ROWS,), V, ignore_every=3)


# --- TypeError ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float64],
                         ids=["int64", "int32", "bool", "float64_not_in_contract_dtypes"])
def test_logits_dtype(backend, dtype):
    x = torch.randint(0, 3, (ROWS, V)).to(dtype)
    _raises(TypeError, backend, x, make_target((ROWS,), V))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.bool],
                         ids=["float32", "bfloat16", "int16", "uint8", "bool"])
def test_target_dtype(backend, dtype):
    x, t = _good()
    _raises(TypeError, backend, x, t.clamp_min(0).to(dtype))


def test_non_tensor_arguments(backend):
    x, t = _good()
    _raises(TypeError, backend, x.detach().tolist(), t)
    _raises(TypeError, backend, x, t.tolist())


# --- ValueError -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("target_shape", [(ROWS + 1,), (ROWS - 1,), (ROWS, 1), (2, 5), ()],
                         ids=["one_more", "one_less", "extra_dim", "reshaped", "scalar"])
def test_shape_mismatch(backend, target_shape):
    x, _ = _good()
    _raises(ValueError, backend, x, torch.zeros(target_shape, dtype=torch.int64))


def test_shape_mismatch_3d(backend):
    x = make_logits((2, 3, V), torch.float32)
    _raises(ValueError, backend, x, torch.zeros(3, 2, dtype=torch.int64))   # transposed leading dims
    _raises(ValueError, backend, x, torch.zeros(6, dtype=torch.int64))      # flattened leading dims


def test_zero_dim_logits(backend):
    _raises(ValueError, backend, torch.tensor(1.0, requires_grad=True), torch.tensor(0))


@pytest.mark.parametrize("reduction", ["avg", "MEAN", "", None, "batchmean"])
def test_bad_reduction(backend, reduction):
    x, t = _good()
    _raises(ValueError, backend, x, t, reduction=reduction)


@pytest.mark.parametrize("eps", [-0.1, 1.0 + 1e-6, 2.0, float("nan")])
def test_bad_label_smoothing(backend, eps):
    x, t = _good()
    _raises(ValueError, backend, x, t, label_smoothing=eps)


@pytest.mark.parametrize("softcap", [0.0, -1.0, -30.0, float("nan")])
def test_bad_softcap(backend, softcap):
    x, t = _good()
    _raises(ValueError, backend, x, t, softcap=softcap)


@pytest.mark.parametrize("shape", [(V + 1,), (V - 1,), (1, V), (V, 1), ()],
                         ids=["V+1", "V-1", "row", "column", "scalar"])
def test_bad_weight_shape(backend, shape):
    x, t = _good()
    _raises(ValueError, backend, x, t, torch.rand(shape))


def test_boundaries_accepted(backend):
    """The closed ends of the valid ranges are accepted: label_smoothing 0 and 1, a tiny softcap."""
    x, t = _good()
    for kw in ({"label_smoothing": 0.0}, {"label_smoothing": 1.0}, {"softcap": 1e-3}):
        assert torch.isfinite(call(x, t, backend=backend, **kw)).all(), kw


def test_different_devices(backend):
    """target / weight on another device ('meta' stands in for a second device on a CPU-only machine)."""
    x, t = _good()
    _raises(ValueError, backend, x, t.to("meta"))
    _raises(ValueError, backend, x, t, make_weight(V).to("meta"))


# --- IndexError ------------------------------------------------------------------------------------------
def _names(msg: str, *numbers) -> bool:
    return all(re.search(rf"(?<![\d.]){n}(?![\d.])", msg) for n in numbers)


@pytest.mark.parametrize("bad", [V, V + 1000, -1, -101, -(2 ** 31)], ids=["V", "V+1000", "-1", "-101", "int32_min"])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_target_out_of_range(backend, bad, index_dtype):
    """The message names the first bad position, its value and V (C8)."""
    x, t = _good()
    t = t.to(index_dtype)
    t[7] = bad
    msg = _raises(IndexError, backend, x, t)
    assert _names(msg, 7, bad, V), msg


def test_target_out_of_range_names_the_first(backend):
    x, t = _good()
    t[4], t[8] = V + 11, V + 22
    msg = _raises(IndexError, backend, x, t)
    assert _names(msg, 4, V + 11, V) and not _names(msg, V + 22), msg


def test_target_out_of_range_multi_dim_position(backend):
    """(B, T) targets: the position is named by its (b, t) index."""
    x = make_logits((3, 5, V), torch.float32)
    t = make_target((3, 5), V, ignore_every=4)
    t[2, 3] = -7
    msg = _raises(IndexError, backend, x, t)
    assert re.search(r"[\[(]\s*2\s*,\s*3\s*[\])]", msg) and _names(msg, -7, V), msg


def test_ignore_index_is_not_a_class(backend):
    """With ignore_index=-1, -100 is an ordinary (bad) target; -1 is fine."""
    x = make_logits((ROWS, V), torch.float32)
    t = make_target((ROWS,), V, ignore_every=3, ignore_index=-1)
    t[5] = -100
    msg = _raises(IndexError, backend, x, t, ignore_index=-1)
    assert _names(msg, 5, -100, V), msg


def test_error_order_before_any_work_with_module(backend):
    """The module raises the same errors (it goes through the same function)."""
    import fusedce
    x, t = _good()
    t[3] = V
    with pytest.raises(IndexError):
        fusedce.CrossEntropyLoss(backend=backend)(x, t)
    with pytest.raises(ValueError):
        fusedce.CrossEntropyLoss(reduction="avg", backend=backend)(x, t)
