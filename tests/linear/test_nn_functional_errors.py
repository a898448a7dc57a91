"""The drop-in's errors (issue 27 item 5): every invalid input of torch's own OpInfo ``error_inputs`` for
``nn.functional.linear_cross_entropy`` gets, from ``fusedce.nn.functional.linear_cross_entropy``, the error
type torch raises and a message matching torch's ``error_regex``; and the target mistakes torch rejects
(float class indices, a 2-D target that is not ``(N, C)``, another batch size, a class out of range) get
torch's error type, torch's function run on the same input as the oracle."""
from __future__ import annotations

import re

import pytest
import torch

import fusedce.nn.functional as FF

F = torch.nn.functional
pytestmark = pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"),
                                reason="torch < 2.13 has no linear_cross_entropy")


def _error_inputs():
    oi = pytest.importorskip("torch.testing._internal.common_methods_invocations")
    ops = [op for op in oi.op_db if op.name == "nn.functional.linear_cross_entropy"]
    assert ops, "torch's op_db has no nn.functional.linear_cross_entropy"
    return list(ops[0].error_inputs("cpu"))


def _raised(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the error is what is compared
        return exc
    return None


def test_opinfo_error_inputs():
    cases = _error_inputs()
    assert len(cases) >= 6
    for case in cases:
        s = case.sample_input
        theirs = _raised(F.linear_cross_entropy, s.input, *s.args, **s.kwargs)
        ours = _raised(FF.linear_cross_entropy, s.input, *s.args, **s.kwargs)
        assert isinstance(theirs, case.error_type), f"torch itself: {theirs!r} for {case.error_regex!r}"
        assert ours is not None, f"no error where torch raises {case.error_regex!r}"
        assert type(ours) is type(theirs), f"{type(ours).__name__} ({ours}) where torch raises {type(theirs).__name__}"
        assert re.search(case.error_regex, str(ours)), f"{str(ours)!r} does not match torch's {case.error_regex!r}"


@pytest.mark.parametrize("case", ["float-indices", "2d-int", "wrong-C-float", "batch", "out-of-range", "bias-first"])
def test_target_mistakes_get_torchs_error_type(case):
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    kwargs = {}
    target = {"float-indices": torch.tensor([1.0, 2.0]), "2d-int": torch.tensor([[1], [2]]),
              "wrong-C-float": torch.rand(2, 5), "batch": torch.tensor([1, 2, 3]),
              "out-of-range": torch.tensor([1, 7]), "bias-first": torch.tensor([1.0, 2.0])}[case]
    if case == "bias-first":   # torch checks the bias before the target
        kwargs["linear_bias"] = torch.zeros(5)
    theirs = _raised(F.linear_cross_entropy, x, w, target, **kwargs)
    ours = _raised(FF.linear_cross_entropy, x, w, target, **kwargs)
    assert theirs is not None and ours is not None, (theirs, ours)
    assert isinstance(ours, type(theirs)), \
        f"{type(ours).__name__} ({ours}) where torch raises {type(theirs).__name__} ({theirs})"


def test_valid_probability_targets_still_run():
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    q = torch.softmax(torch.randn(2, 4), -1)
    torch.testing.assert_close(FF.linear_cross_entropy(x, w, q), F.linear_cross_entropy(x, w, q).float())


def test_fusedce_errors_name_the_drop_ins_arguments():
    """Past torch's own checks, fusedce's errors name the drop-in's arguments (``input``, ``linear_weight``,
    ``linear_bias``, ``weight`` for the class weights), not ``fusedce.linear_cross_entropy``'s (``hidden``,
    ``weight``, ``bias``, ``ce_weight``)."""
    h, W, t = torch.randn(8, 4), torch.randn(10, 4), torch.randint(0, 10, (8,))
    cases = [(dict(weight=torch.ones(11)), ValueError, r"^weight must have shape \(10,\)"),
             (dict(weight=torch.ones(10, dtype=torch.long)), TypeError, r"^weight must be a floating-point"),
             (dict(linear_bias=torch.ones(10, dtype=torch.float64)), TypeError,
              r"^input, linear_weight and linear_bias must share a dtype")]
    for kw, kind, pattern in cases:
        with pytest.raises(kind, match=pattern):
            FF.linear_cross_entropy(h, W, t, **kw)
    with pytest.raises(TypeError, match=r"^input must be float32"):
        FF.linear_cross_entropy(h.double(), W.double(), t)


def test_byte_class_indices_are_accepted_as_torch_does():
    h, W, t = torch.randn(8, 4), torch.randn(10, 4), torch.randint(0, 10, (8,))
    expected = torch.nn.functional.cross_entropy(h @ W.t(), t)
    torch.testing.assert_close(FF.linear_cross_entropy(h, W, t.to(torch.uint8)), expected)


def test_every_opinfo_variants_error_inputs():
    """The same error inputs through each of torch's linear_cross_entropy OpInfos (the plain, ``chunked`` and
    ``chunked_none`` variants), should a variant add its own."""
    oi = pytest.importorskip("torch.testing._internal.common_methods_invocations")
    ops = [op for op in oi.op_db if op.name == "nn.functional.linear_cross_entropy"]
    for op in ops:
        for case in op.error_inputs("cpu"):
            s = case.sample_input
            ours = _raised(FF.linear_cross_entropy, s.input, *s.args, **s.kwargs)
            assert isinstance(ours, case.error_type) and re.search(case.error_regex, str(ours)), (op.variant_test_name,
                                                                                                 ours)


# Issue 46 item 7: a target of the probabilities' shape ((N, C), or (C,) for an unbatched input) is a
# probability target whatever its dtype, as torch decides (the shape first, then ignore_index, then the
# dtype): an integer one got "multi-target not supported ... class probabilities need (N, C)" for a target
# that had that shape. Torch's own function is the oracle: the same error type, and fusedce's message starts
# with torch's (then its hint). Class-index targets of another dtype are checked the same way.
_NOT_FLOAT = (torch.int64, torch.int32, torch.uint8, torch.int8, torch.int16, torch.bool, torch.complex64)
_NOT_INDEX = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool, torch.int8, torch.int16,
              torch.complex64)


def _compare_with_torch(x, w, target, **kwargs):
    theirs = _raised(F.linear_cross_entropy, x, w, target, **kwargs)
    ours = _raised(FF.linear_cross_entropy, x, w, target, **kwargs)
    assert theirs is not None, "torch accepts this input: not an error input"
    assert type(ours) is type(theirs), f"{type(ours).__name__} ({ours}) where torch raises {type(theirs).__name__}"
    assert str(ours).startswith(str(theirs)), f"{str(ours)!r} where torch says {str(theirs)!r}"


@pytest.mark.parametrize("kwargs", [{}, {"ignore_index": 0}, {"label_smoothing": 0.1}, {"reduction": "none"}],
                         ids=["plain", "ignore_index", "label_smoothing", "none"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("dtype", _NOT_FLOAT, ids=str)
def test_non_float_target_of_the_probabilities_shape(dtype, batched, kwargs):
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    if not batched:
        x = x[0]
    target = torch.ones(x.shape[:-1] + (4,), dtype=dtype)
    _compare_with_torch(x, w, target, **kwargs)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("dtype", _NOT_INDEX, ids=str)
def test_class_index_target_of_another_dtype(dtype, batched):
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    if not batched:
        x = x[0]
    _compare_with_torch(x, w, torch.ones(x.shape[:-1], dtype=dtype))


def test_probability_targets_with_bias_and_class_weights_run():
    """Valid probability targets (float dtypes, with a bias and class weights, unbatched) still run, as torch."""
    x, w, b, cw = torch.randn(3, 5), torch.randn(4, 5), torch.randn(4), torch.rand(4)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        q = torch.softmax(torch.randn(3, 4), -1).to(dtype)
        for xs, qs in ((x, q), (x[0], q[0])):
            expected = F.linear_cross_entropy(xs, w, qs.float(), linear_bias=b, weight=cw)
            torch.testing.assert_close(FF.linear_cross_entropy(xs, w, qs, linear_bias=b, weight=cw), expected)
