"""Every error of the contract, raised before anything is written: the caller's tensors are unchanged
afterwards (inplace_backward=True is passed so that an early write would have a place to land)."""
import re

import numpy as np
import pytest
import torch

import fusedce
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


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.bool], ids=["int16", "uint8", "bool"])
def test_target_dtype(backend, dtype):
    x, t = _good()
    _raises(TypeError, backend, x, t.clamp_min(0).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_float_class_indices(backend, dtype):
    """A float target is a probability target of ``logits.shape``; class indices stored as floats
    (``logits.shape[:-1]``) are a ValueError naming both shapes and the fix."""
    x, t = _good()
    _raises(ValueError, backend, x, t.clamp_min(0).to(dtype), match=rf"shape \({ROWS}, {V}\).*got \({ROWS},\).*"
            r"target\.long\(\)")


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


def test_class_dimension_one_layout_is_named(backend):
    """Logits in F.cross_entropy's layout (N, C, d1) with its target (N, d1): the message says the class
    dimension is last here and how to move it; other mismatches get no such hint."""
    x = make_logits((2, V, 4), torch.float32)
    msg = _raises(ValueError, backend, x, torch.zeros(2, 4, dtype=torch.int64))
    assert "(2, 4) must equal (2, 37)" in msg and "class dimension is LAST" in msg, msg
    assert f"C = {V} classes in dimension 1" in msg and "logits.movedim(1, -1)" in msg, msg
    assert "movedim" not in _raises(ValueError, backend, x, torch.zeros(4, 2, dtype=torch.int64))


def test_transposed_logits_are_named(backend):
    """(V, BT) logits with a target of BT tokens: the message says the classes go last and to transpose;
    a square (V, V) pair or a target of another length gets no such hint."""
    x = make_logits((V, 6), torch.float32)
    msg = _raises(ValueError, backend, x, torch.zeros(6, dtype=torch.int64))
    assert "look transposed" in msg and "logits.t()" in msg and f"V = {V}" in msg, msg
    assert "transposed" not in _raises(ValueError, backend, x, torch.zeros(5, dtype=torch.int64))
    assert "transposed" not in _raises(ValueError, backend, make_logits((6, 6), torch.float32),
                                       torch.zeros(5, dtype=torch.int64))


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


def test_class_weights_that_require_grad(backend):
    """As ``F.cross_entropy``: a learnable class weight would silently get no gradient, so it is refused while
    grad mode is on (and accepted under ``torch.no_grad()``, where nothing is learned)."""
    x, t = _good()
    w = torch.rand(V, requires_grad=True)
    msg = _raises(TypeError, backend, x, t, w, match="weight requires grad")
    assert "weight.detach()" in msg
    h, head = torch.randn(ROWS, 8), torch.randn(V, 8)
    with pytest.raises(TypeError, match="ce_weight requires grad"):
        fusedce.linear_cross_entropy(h, head, t, ce_weight=w, backend=backend)
    with torch.no_grad():
        call(x, t, w, backend=backend)
        fusedce.linear_cross_entropy(h, head, t, ce_weight=w, backend=backend)


def test_shape_error_reaches_the_user_under_fullgraph_compile():
    """Under ``torch.compile(fullgraph=True, dynamic=True)`` the message is built from symbolic shapes: it must
    be one f-string (Dynamo cannot concatenate such a string), so that Dynamo reports the formatted
    ``ValueError`` (the pattern matches the formatted text, not the source line it also quotes)."""
    g = torch.compile(lambda z, y: fusedce.cross_entropy(z, y, backend="torch"), fullgraph=True, dynamic=True)
    with pytest.raises(Exception, match=r"target shape \(s\d+,\) must equal \(s\d+,\)"):
        g(torch.randn(16, V), torch.randint(0, V, (15,)))


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


# --- int32 target vs a wide ignore_index, strict scalar options, V = 0, module checks -------
def _equal_outputs(a, b):
    """Two CrossEntropyOutput (or two tensors) bit for bit."""
    pairs = zip(a, b) if isinstance(a, fusedce.CrossEntropyOutput) else [(a, b)]
    return all(bit_identical(x.detach(), y.detach()) for x, y in pairs)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_int32_target_ignore_index_beyond_int32(backend, reduction):
    """ignore_index = 2**40 wraps to 0 in int32: class 0 (row 0) must not be ignored. The result equals
    the int64 target's, bit for bit, and the caller's int32 target is left as it is."""
    x = make_logits((ROWS, V), torch.float32)
    t64 = make_target((ROWS,), V)                  # no ignored row; t64[0] == 0
    t32 = t64.to(torch.int32)
    assert int(t64[0]) == 0
    kw = dict(reduction=reduction, return_stats=True, backend=backend)
    wide = fusedce.cross_entropy(x, t32, ignore_index=2 ** 40, **kw)
    plain = fusedce.cross_entropy(x, t64, ignore_index=2 ** 40, **kw)
    assert _equal_outputs(wide, plain)
    assert bool((wide.predicted_tokens >= 0).all()), "a row was treated as ignored"
    assert t32.dtype == torch.int32
    # -2**40 (wraps to 0 as well), and the int64 extremes
    for ignore in (-(2 ** 40), 2 ** 63 - 1, -(2 ** 63)):
        assert _equal_outputs(fusedce.cross_entropy(x, t32, ignore_index=ignore, **kw),
                              fusedce.cross_entropy(x, t64, ignore_index=ignore, **kw)), ignore


def test_int32_target_default_ignore_index(backend):
    """An ignore_index inside int32 (-100) keeps working on int32 targets: equal to int64."""
    x = make_logits((ROWS, V), torch.float32)
    t64 = make_target((ROWS,), V, ignore_every=3)
    for reduction in ("mean", "sum", "none"):
        a = call(x, t64.to(torch.int32), backend=backend, reduction=reduction, return_stats=True)
        b = call(x, t64, backend=backend, reduction=reduction, return_stats=True)
        assert _equal_outputs(a, b), reduction
        assert bool((a.predicted_tokens.reshape(-1)[1::3] == -1).all())


@pytest.mark.parametrize("ignore_index", [2 ** 63, -(2 ** 63) - 1, 2 ** 100])
def test_ignore_index_outside_int64(backend, ignore_index):
    x, t = _good()
    msg = _raises(ValueError, backend, x, t, ignore_index=ignore_index)
    assert "ignore_index" in msg and "int64" in msg, msg


NOT_INTEGERS = {"1.5": 1.5, "2.0": 2.0, "True": True, "str": "3", "float_tensor": torch.tensor(1.0),
                "bool_tensor": torch.tensor(False), "None": None, "np_float": np.float64(-100.0)}


@pytest.mark.parametrize("name", list(NOT_INTEGERS))
def test_ignore_index_not_an_integer(backend, name):
    """A float (even integral), a bool, a string: TypeError naming the option and the value, never a
    silent int()."""
    x, t = _good()
    value = NOT_INTEGERS[name]
    msg = _raises(TypeError, backend, x, t, ignore_index=value)
    assert "ignore_index" in msg and repr(value) in msg, msg


@pytest.mark.parametrize("value", [np.int64(-1), np.int32(-1), torch.tensor(-1), torch.tensor(-1, dtype=torch.int32)],
                         ids=["np_int64", "np_int32", "tensor_int64", "tensor_int32"])
def test_ignore_index_integer_like_accepted(backend, value):
    """Anything operator.index takes (NumPy integers, one-element integer tensors) is the int."""
    x = make_logits((ROWS, V), torch.float32)
    t = make_target((ROWS,), V, ignore_every=3, ignore_index=-1)
    assert _equal_outputs(call(x, t, backend=backend, ignore_index=value, return_stats=True),
                          call(x, t, backend=backend, ignore_index=-1, return_stats=True))


NON_FINITE = [float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("option", ["label_smoothing", "lse_square_scale", "softcap"])
@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_real_options_non_finite(backend, option, value):
    x, t = _good()
    msg = _raises(ValueError, backend, x, t, **{option: value})
    assert option in msg, msg


@pytest.mark.parametrize("option", ["label_smoothing", "lse_square_scale", "softcap"])
@pytest.mark.parametrize("value", ["0.1", True, [0.1], torch.tensor([0.1, 0.2]), 1j],
                         ids=["str", "bool", "list", "2_elem_tensor", "complex"])
def test_real_options_not_numbers(backend, option, value):
    x, t = _good()
    msg = _raises(TypeError, backend, x, t, **{option: value})
    assert option in msg, msg


def test_real_options_numpy_and_tensor_accepted(backend):
    """NumPy floats and one-element float tensors are numbers: the same result as Python floats."""
    x, t = _good()
    ref = call(x, t, backend=backend, label_smoothing=0.25, lse_square_scale=0.5, softcap=4.0)
    for kind in (np.float32, np.float64, torch.tensor):
        got = call(x, t, backend=backend, label_smoothing=kind(0.25), lse_square_scale=kind(0.5),
                   softcap=kind(4.0))
        assert bit_identical(got.detach(), ref.detach()), kind


@pytest.mark.parametrize("value", [-1, -0.5, float("nan"), float("inf"), -float("inf")],
                         ids=["-1", "-0.5", "nan", "inf", "-inf"])
def test_num_items_bad_value(backend, value):
    x, t = _good()
    msg = _raises(ValueError, backend, x, t, num_items_in_batch=value)
    assert "num_items_in_batch" in msg, msg


@pytest.mark.parametrize("option,value", [("softcap", 1e39), ("softcap", 1e300), ("lse_square_scale", 1e39),
                                          ("num_items_in_batch", 1e300), ("num_items_in_batch", 1e-300),
                                          ("num_items_in_batch", torch.tensor(1e-300, dtype=torch.float64))],
                         ids=["softcap_1e39", "softcap_1e300", "zloss_1e39", "num_items_1e300", "num_items_1e-300",
                              "num_items_tensor_1e-300"])
def test_options_beyond_fp32(backend, option, value):
    """Finite in Python but not in the kernels' fp32 math (inf: NaN rows, inf * 0 on ignored rows; or a
    denominator that rounds to 0): ValueError naming the option, before any work."""
    x, t = _good()
    msg = _raises(ValueError, backend, x, t, **{option: value})
    assert option in msg and "fp32" in msg, msg


@pytest.mark.parametrize("value", [True, False, "3", [3], torch.tensor(True)],
                         ids=["True", "False", "str", "list", "bool_tensor"])
def test_num_items_not_a_number(backend, value):
    x, t = _good()
    msg = _raises(TypeError, backend, x, t, num_items_in_batch=value)
    assert "num_items_in_batch" in msg, msg


def test_num_items_numbers_accepted(backend):
    """0 (loss 0.0), a float, a NumPy integer and a tensor are all valid denominators."""
    x, t = _good()
    assert float(call(x, t, backend=backend, num_items_in_batch=0).detach()) == 0.0
    ref = call(x, t, backend=backend, num_items_in_batch=4)
    for value in (4.0, np.int64(4), torch.tensor(4)):
        assert bit_identical(call(x, t, backend=backend, num_items_in_batch=value).detach(), ref.detach())


@pytest.mark.parametrize("shape", [(ROWS, 0), (2, 5, 0), (0, 0)], ids=["2d", "3d", "no_rows"])
def test_zero_classes(backend, shape):
    """V = 0: ValueError naming V, whatever the targets (all ignored, or class 0)."""
    x = torch.zeros(shape, requires_grad=True)
    for fill in (-100, 0):
        msg = _raises(ValueError, backend, x, torch.full(shape[:-1], fill, dtype=torch.int64))
        assert "V = 0" in msg, msg


# --- CrossEntropyLoss checks its options at construction, with the function's errors -------------------
MODULE_BAD = {
    "reduction": ({"reduction": "avg"}, ValueError),
    "smoothing_range": ({"label_smoothing": 1.5}, ValueError),
    "smoothing_nan": ({"label_smoothing": float("nan")}, ValueError),
    "smoothing_str": ({"label_smoothing": "0.1"}, TypeError),
    "zloss_inf": ({"lse_square_scale": float("inf")}, ValueError),
    "softcap_0": ({"softcap": 0.0}, ValueError),
    "softcap_inf": ({"softcap": float("inf")}, ValueError),
    "ignore_float": ({"ignore_index": 1.5}, TypeError),
    "ignore_bool": ({"ignore_index": True}, TypeError),
    "ignore_wide": ({"ignore_index": 2 ** 64}, ValueError),
    "backend": ({"backend": "cuda"}, ValueError),
    "weight_2d": ({"weight": torch.ones(V, 1)}, ValueError),
    "weight_int": ({"weight": torch.ones(V, dtype=torch.int64)}, TypeError),
    "weight_list": ({"weight": [1.0] * V}, TypeError),
}


@pytest.mark.parametrize("name", list(MODULE_BAD))
def test_module_checks_options_at_construction(name):
    """The constructor raises what the function raises for the same option (type and message)."""
    kw, exc = MODULE_BAD[name]
    with pytest.raises(exc) as at_init:
        fusedce.CrossEntropyLoss(**kw)
    x, t = _good()
    weight = kw.get("weight")
    options = {k: v for k, v in kw.items() if k != "weight"}
    with pytest.raises(exc) as at_call:
        fusedce.cross_entropy(x, t, weight, **{"backend": "torch", **options})
    if name == "ignore_bool":   # the constructor adds the hint for torch's positional size_average
        assert str(at_init.value).startswith(str(at_call.value) + ": the second positional argument")
    elif name != "weight_2d":   # the function names V in its message, the constructor cannot know it
        assert str(at_init.value) == str(at_call.value)
    else:
        assert "weight must have shape" in str(at_init.value) and "weight must have shape" in str(at_call.value)


def test_module_valid_options_accepted():
    """Valid options construct (None backend: $FUSEDCE_BACKEND is read at each call)."""
    for kw in ({}, {"backend": "triton"}, {"backend": "auto"}, {"weight": make_weight(V)},
               {"ignore_index": np.int64(-1), "label_smoothing": 1.0, "softcap": 1e-3}):
        fusedce.CrossEntropyLoss(**kw)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("-inf")])
def test_num_items_cpu_tensor_value_checked(backend, bad):
    """A CPU tensor's value is read without any device sync: the same ValueError as a number."""
    x, t = torch.randn(4, 6), torch.tensor([1, 2, -100, 3])
    with pytest.raises(ValueError, match="num_items_in_batch"):
        fusedce.cross_entropy(x, t, num_items_in_batch=torch.tensor(bad), backend=backend)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        fusedce.linear_cross_entropy(torch.randn(4, 3), torch.randn(6, 3), t, num_items_in_batch=torch.tensor(bad),
                                     backend=backend)


@pytest.mark.parametrize("name", ["return_stats", "inplace_backward"])
@pytest.mark.parametrize("bad", ["no", 1, None])
def test_flags_must_be_bools(backend, name, bad):
    """A string flag would count as True on one backend and break the other's op schema: TypeError."""
    x, t = torch.randn(4, 6), torch.tensor([1, 2, -100, 3])
    with pytest.raises(TypeError, match=name):
        fusedce.cross_entropy(x, t, backend=backend, **{name: bad})
    with pytest.raises(TypeError, match=name):
        fusedce.CrossEntropyLoss(**{name: bad})


def test_cute_backend_is_named_but_not_available():
    """backend="cute" (the CuTe DSL backend) needs CUDA tensors: on CPU tensors it raises RuntimeError
    naming "cute" (and CUDA; tests/cute/test_cute_backend.py checks the message and the missing-extra case)."""
    x, t = torch.randn(4, 6), torch.tensor([1, 2, -100, 3])
    with pytest.raises(RuntimeError, match="cute"):
        fusedce.cross_entropy(x, t, backend="cute")


def test_an_integer_target_of_the_logits_shape_says_probabilities_must_be_float():
    """An integer (N, V) target: the shape error says class probabilities are a float tensor (before: only
    "target shape (8, 32) must equal (8,)")."""
    with pytest.raises(ValueError, match="class probabilities must be a floating-point tensor"):
        fusedce.cross_entropy(torch.randn(8, 32), torch.zeros(8, 32, dtype=torch.long))
    with pytest.raises(ValueError, match="class probabilities must be a floating-point tensor"):
        fusedce.linear_cross_entropy(torch.randn(8, 4), torch.randn(32, 4), torch.zeros(8, 32, dtype=torch.long))


def test_module_names_torchs_positional_size_average():
    """``CrossEntropyLoss(weight, True)`` as torch's ``(weight, size_average)``: the TypeError says the second
    positional argument is ignore_index and where the reduction goes."""
    with pytest.raises(TypeError, match=r"second positional argument here is ignore_index.*reduction="):
        fusedce.CrossEntropyLoss(None, True)
    with pytest.raises(TypeError, match="ignore_index must be an integer"):
        fusedce.CrossEntropyLoss(ignore_index=2.5)


def test_swapped_logits_and_target_are_named():
    """Fresh-user finding: ``cross_entropy(target, logits)`` said only "logits must be float"; the linear ops
    already hinted at swapped arguments."""
    logits, target = make_logits((4, 5), torch.float32), make_target((4,), 5)
    with pytest.raises(TypeError, match=r"got torch\.int64, and target is torch\.float32: logits and target "
                                        r"swapped\?"):
        fusedce.cross_entropy(target, logits)
    with pytest.raises(TypeError, match=r"logits must be float32, bfloat16 or float16, got torch\.int64$"):
        fusedce.cross_entropy(target, target)   # no float target: no swap suggested


def test_device_mismatch_names_the_argument():
    """Fresh-user finding: "target is on cpu but the data is on meta" named no argument."""
    x, t = torch.randn(6, 16, device="meta"), torch.randint(0, 16, (6,))
    with pytest.raises(ValueError, match=r"target is on cpu but logits is on meta"):
        fusedce.cross_entropy(x, t)
    with pytest.raises(ValueError, match=r"target is on cpu but logits is on meta"):
        fusedce.token_log_probs(x, t)
    with pytest.raises(ValueError, match=r"target is on cpu but hidden is on meta"):
        fusedce.linear_cross_entropy(torch.randn(6, 4, device="meta"), torch.randn(16, 4, device="meta"), t)
