"""Every error of the contract for ``linear_cross_entropy`` (and its module), raised before anything is
written: the caller's tensors are bit-identical afterwards and no gradient reached them."""
import re

import numpy as np
import pytest
import torch

import fusedce
from inputs import bit_identical, make_target, make_weight
from reference64_linear import make_linear

ROWS, H, V = 10, 8, 37   # V = 37: a small prime, so V appears in messages unambiguously


def _good(dtype=torch.float32):
    hidden, weight, bias = make_linear((ROWS,), H, V, dtype, bias=True)
    return hidden, weight, bias, make_target((ROWS,), V, ignore_every=3)


def _raises(exc, backend, hidden, weight, target, bias=None, match=None, **kw):
    """Call, expect ``exc``; then check that no argument was modified (nor got a gradient)."""
    args = (hidden, weight, target, bias, kw.get("ce_weight"))
    saved = [t.detach().clone() if isinstance(t, torch.Tensor) and t.device.type != "meta" else None
             for t in args]
    with pytest.raises(exc, match=match) as info:
        fusedce.linear_cross_entropy(hidden, weight, target, bias, backend=backend, **kw)
    for before, after in zip(saved, args):
        if before is not None:
            assert bit_identical(after.detach(), before), "an argument was modified before the error"
            assert not after.is_leaf or after.grad is None
    return str(info.value)


# --- TypeError ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bool], ids=["int64", "float64", "bool"])
def test_hidden_and_weight_dtype(backend, dtype):
    hidden, weight, bias, target = _good()
    _raises(TypeError, backend, hidden.detach().to(dtype), weight, target)
    _raises(TypeError, backend, hidden, weight.detach().to(dtype), target)


@pytest.mark.parametrize("which", ["weight", "bias"])
@pytest.mark.parametrize("pair", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
                                  (torch.float16, torch.float32)], ids=["fp32_bf16", "bf16_fp16", "fp16_fp32"])
def test_dtype_mismatch(backend, pair, which):
    """hidden, weight and bias must share a dtype (TypeError)."""
    hidden, weight, bias, target = _good(pair[0])
    if which == "weight":
        weight = weight.detach().to(pair[1]).requires_grad_()
        bias = None
    else:
        bias = bias.detach().to(pair[1]).requires_grad_()
    _raises(TypeError, backend, hidden, weight, target, bias)


# A float target holds class probabilities (issue 30): one of hidden.shape[:-1] is a ValueError naming
# target.long() (test_linear_soft_targets.py::test_errors), not a TypeError.
@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.bool])
def test_target_dtype(backend, dtype):
    hidden, weight, bias, target = _good()
    _raises(TypeError, backend, hidden, weight, target.clamp_min(0).to(dtype), bias)


def test_non_tensor_arguments(backend):
    hidden, weight, bias, target = _good()
    _raises(TypeError, backend, hidden.detach().tolist(), weight, target)
    _raises(TypeError, backend, hidden, weight.detach().tolist(), target)
    _raises(TypeError, backend, hidden, weight, target.tolist())


# --- ValueError -----------------------------------------------------------------------------------------
def test_hidden_size_mismatch(backend):
    hidden, weight, bias, target = _good()
    msg = _raises(ValueError, backend, hidden, weight[:, :H - 1], target, bias)
    assert str(H) in msg and str(H - 1) in msg, msg
    _raises(ValueError, backend, hidden[:, :H - 1], weight, target, bias)
    _raises(ValueError, backend, hidden, weight.t(), target)                # (H, V) instead of (V, H)


@pytest.mark.parametrize("shape", [(V * H,), (1, V, H)], ids=["1d", "3d"])
def test_weight_not_2d(backend, shape):
    hidden, weight, _, target = _good()
    _raises(ValueError, backend, hidden, weight.detach().reshape(shape), target)


def test_zero_dim_hidden(backend):
    _, weight, _, _ = _good()
    _raises(ValueError, backend, torch.tensor(1.0), weight, torch.tensor(0))


@pytest.mark.parametrize("shape", [(V + 1,), (V - 1,), (1, V), (V, 1), ()],
                         ids=["V+1", "V-1", "row", "col", "scalar"])
@pytest.mark.parametrize("which", ["bias", "ce_weight"])
def test_bad_vector_shape(backend, which, shape):
    """bias and ce_weight must be (V,)."""
    hidden, weight, _, target = _good()
    vec = torch.rand(shape)
    if which == "bias":
        _raises(ValueError, backend, hidden, weight, target, vec)
    else:
        _raises(ValueError, backend, hidden, weight, target, ce_weight=vec)


@pytest.mark.parametrize("target_shape", [(ROWS + 1,), (ROWS, 1), (2, 5), ()],
                         ids=["one_more", "extra_dim", "reshaped", "scalar"])
def test_target_shape_mismatch(backend, target_shape):
    hidden, weight, bias, _ = _good()
    _raises(ValueError, backend, hidden, weight, torch.zeros(target_shape, dtype=torch.int64), bias)


def test_flattened_target_gets_the_view_hint(backend):
    """A flat ``(B*T,)`` target beside ``(B, T, H)`` hidden states (and the reverse): the message gives the
    ``target.view`` that fits; a target with another number of tokens gets no such hint."""
    hidden, weight, _, target = _good()
    hidden3 = hidden.detach().reshape(2, ROWS // 2, H)
    msg = _raises(ValueError, backend, hidden3, weight, target)
    assert f"pass target.view(2, {ROWS // 2})" in msg, msg
    msg = _raises(ValueError, backend, hidden, weight, target.reshape(2, ROWS // 2))
    assert f"pass target.view({ROWS},)" in msg, msg
    assert "target.view" not in _raises(ValueError, backend, hidden3, weight, target[:-1])


def test_hidden_and_weight_swapped_is_named(backend):
    """linear_cross_entropy(weight, hidden, target): the message says the two look swapped (2-D and 3-D
    hidden states)."""
    hidden, weight, bias, target = _good()
    msg = _raises(ValueError, backend, weight, hidden, target)
    assert f"({ROWS},) must equal ({V},)" in msg and "look swapped" in msg, msg
    hidden3 = hidden.detach().reshape(2, ROWS // 2, H)
    msg = _raises(ValueError, backend, weight, hidden3, target.reshape(2, ROWS // 2))
    assert "look swapped" in msg, msg
    assert "swapped" not in _raises(ValueError, backend, hidden, weight, target[:-1])


def test_class_weights_as_weight_keyword_points_to_ce_weight(backend):
    """``weight=`` meaning the class weights (the head given by position): a TypeError naming ce_weight,
    not only Python's "got multiple values for argument 'weight'"."""
    hidden, weight, bias, target = _good()
    with pytest.raises(TypeError, match=r"multiple values for argument 'weight'.*LM head.*ce_weight="):
        fusedce.linear_cross_entropy(hidden, weight, target, weight=torch.rand(V), backend=backend)
    as_keywords = fusedce.linear_cross_entropy(hidden=hidden, weight=weight, target=target, backend=backend)
    torch.testing.assert_close(as_keywords, fusedce.linear_cross_entropy(hidden, weight, target, backend=backend))


BAD_OPTIONS = {
    "reduction_avg": {"reduction": "avg"}, "reduction_None": {"reduction": None},
    "reduction_batchmean": {"reduction": "batchmean"},
    "smoothing_-0.1": {"label_smoothing": -0.1}, "smoothing_1.01": {"label_smoothing": 1.01},
    "smoothing_nan": {"label_smoothing": float("nan")},
    "softcap_0": {"softcap": 0.0}, "softcap_-30": {"softcap": -30.0}, "softcap_nan": {"softcap": float("nan")},
    "chunk_0": {"chunk_size": 0}, "chunk_-1": {"chunk_size": -1},
}


@pytest.mark.parametrize("name", list(BAD_OPTIONS))
def test_bad_options(backend, name):
    hidden, weight, bias, target = _good()
    _raises(ValueError, backend, hidden, weight, target, bias, **BAD_OPTIONS[name])


def test_boundaries_accepted(backend):
    """The closed ends are accepted: smoothing 0 and 1, a tiny softcap, chunk_size 1."""
    hidden, weight, bias, target = _good()
    for kw in ({"label_smoothing": 0.0}, {"label_smoothing": 1.0}, {"softcap": 1e-3}, {"chunk_size": 1}):
        loss = fusedce.linear_cross_entropy(hidden, weight, target, bias, backend=backend, **kw)
        assert bool(torch.isfinite(loss)), kw


def test_different_devices(backend):
    """weight / target / bias / ce_weight on another device ('meta' stands in for a second device)."""
    hidden, weight, bias, target = _good()
    _raises(ValueError, backend, hidden, weight.detach().to("meta"), target)
    _raises(ValueError, backend, hidden, weight, target.to("meta"))
    _raises(ValueError, backend, hidden, weight, target, bias.detach().to("meta"))
    _raises(ValueError, backend, hidden, weight, target, ce_weight=make_weight(V).to("meta"))


def test_backend_names(monkeypatch):
    hidden, weight, bias, target = _good()
    msg = _raises(ValueError, "cuda", hidden, weight, target)
    assert "torch" in msg and "triton" in msg, "the error lists the valid names"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _raises(RuntimeError, "triton", hidden, weight, target, match="TRITON_INTERPRET")


# --- IndexError ------------------------------------------------------------------------------------------
def _names(msg: str, *numbers) -> bool:
    return all(re.search(rf"(?<![\d.]){n}(?![\d.])", msg) for n in numbers)


@pytest.mark.parametrize("bad", [V, V + 1000, -1, -101], ids=["V", "V+1000", "-1", "-101"])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_target_out_of_range(backend, bad, index_dtype):
    """C8 for the linear op: names the first bad position, its value and V."""
    hidden, weight, bias, target = _good()
    target = target.to(index_dtype)
    target[7] = bad
    msg = _raises(IndexError, backend, hidden, weight, target, bias)
    assert _names(msg, 7, bad, V), msg


def test_target_out_of_range_first_and_multi_dim(backend):
    hidden, weight, _ = make_linear((3, 5), H, V)
    target = make_target((3, 5), V, ignore_every=4)
    target[2, 3], target[2, 4] = -7, V + 22
    msg = _raises(IndexError, backend, hidden, weight, target)
    assert re.search(r"[\[(]\s*2\s*,\s*3\s*[\])]", msg) and _names(msg, -7, V) and not _names(msg, V + 22), msg


def test_ignore_index_is_not_a_class(backend):
    """With ignore_index=-1, -100 is a bad target; -1 rows are fine."""
    hidden, weight, bias, _ = _good()
    target = make_target((ROWS,), V, ignore_every=3, ignore_index=-1)
    target[5] = -100
    msg = _raises(IndexError, backend, hidden, weight, target, bias, ignore_index=-1)
    assert _names(msg, 5, -100, V), msg


def test_module_raises_the_same(backend):
    hidden, weight, bias, target = _good()
    target[3] = V
    with pytest.raises(IndexError):
        fusedce.LinearCrossEntropyLoss(backend=backend)(hidden, weight, target, bias)
    with pytest.raises(ValueError):
        fusedce.LinearCrossEntropyLoss(chunk_size=0, backend=backend)(hidden, weight, target.clamp(max=V - 1))
    with pytest.raises(TypeError):
        fusedce.LinearCrossEntropyLoss(backend=backend)(hidden, weight.detach().half(), target.clamp(max=V - 1))


# --- int32 target vs a wide ignore_index, strict scalar options, V = 0 and H = 0 ----------------------
def _equal_outputs(a, b):
    pairs = zip(a, b) if isinstance(a, fusedce.CrossEntropyOutput) else [(a, b)]
    return all(bit_identical(x.detach(), y.detach()) for x, y in pairs)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_int32_target_ignore_index_beyond_int32(backend, reduction):
    """ignore_index = 2**40 wraps to 0 in int32: class 0 (row 0) must be computed, not dropped; the
    result equals the int64 target's. ignore_index=-100 on an int32 target keeps working."""
    hidden, weight, bias, _ = _good()
    t64 = make_target((ROWS,), V)                   # no ignored row; t64[0] == 0
    kw = dict(reduction=reduction, return_stats=True, backend=backend)
    wide = fusedce.linear_cross_entropy(hidden, weight, t64.to(torch.int32), bias, ignore_index=2 ** 40, **kw)
    plain = fusedce.linear_cross_entropy(hidden, weight, t64, bias, ignore_index=2 ** 40, **kw)
    assert _equal_outputs(wide, plain)
    assert bool((wide.predicted_tokens >= 0).all()), "a row was treated as ignored"
    t64 = make_target((ROWS,), V, ignore_every=3)
    a = fusedce.linear_cross_entropy(hidden, weight, t64.to(torch.int32), bias, **kw)
    b = fusedce.linear_cross_entropy(hidden, weight, t64, bias, **kw)
    assert _equal_outputs(a, b)


@pytest.mark.parametrize("value", [2.7, 2.0, True, "4", torch.tensor(2.0)],
                         ids=["2.7", "2.0", "True", "str", "float_tensor"])
def test_chunk_size_not_an_integer(backend, value):
    """chunk_size=2.7 is a TypeError naming it, not a silent int() to 2."""
    hidden, weight, bias, target = _good()
    msg = _raises(TypeError, backend, hidden, weight, target, bias, chunk_size=value)
    assert "chunk_size" in msg and repr(value) in msg, msg


def test_chunk_size_integer_like_accepted(backend):
    hidden, weight, bias, target = _good()
    def run(c):
        return fusedce.linear_cross_entropy(hidden, weight, target, bias, chunk_size=c, backend=backend).detach()

    ref = run(3)
    for value in (np.int64(3), np.int32(3), torch.tensor(3)):
        assert bit_identical(run(value), ref), value


@pytest.mark.parametrize("value", [1.5, True, "0"], ids=["1.5", "True", "str"])
def test_ignore_index_not_an_integer(backend, value):
    hidden, weight, bias, target = _good()
    msg = _raises(TypeError, backend, hidden, weight, target, bias, ignore_index=value)
    assert "ignore_index" in msg and repr(value) in msg, msg


def test_ignore_index_outside_int64(backend):
    hidden, weight, bias, target = _good()
    msg = _raises(ValueError, backend, hidden, weight, target, bias, ignore_index=-(2 ** 63) - 1)
    assert "ignore_index" in msg and "int64" in msg, msg


@pytest.mark.parametrize("option", ["label_smoothing", "lse_square_scale", "softcap"])
def test_real_options_non_finite_or_not_numbers(backend, option):
    hidden, weight, bias, target = _good()
    for value in (float("nan"), float("inf"), -float("inf")):
        assert option in _raises(ValueError, backend, hidden, weight, target, bias, **{option: value})
    for value in ("0.1", True, None if option != "softcap" else [1.0]):
        assert option in _raises(TypeError, backend, hidden, weight, target, bias, **{option: value})


def test_num_items(backend):
    hidden, weight, bias, target = _good()
    for value in (-1, float("nan"), float("inf")):
        assert "num_items_in_batch" in _raises(ValueError, backend, hidden, weight, target, bias,
                                               num_items_in_batch=value)
    for value in (True, "3", torch.tensor(True)):
        assert "num_items_in_batch" in _raises(TypeError, backend, hidden, weight, target, bias,
                                               num_items_in_batch=value)


@pytest.mark.parametrize("value", [torch.int32, torch.bool, "float32", None, torch.complex64],
                         ids=["int32", "bool", "str", "None", "complex64"])
def test_accum_dtype_not_floating(backend, value):
    hidden, weight, bias, target = _good()
    msg = _raises(TypeError, backend, hidden, weight, target, bias, accum_dtype=value)
    assert "accum_dtype" in msg, msg


def test_zero_vocabulary(backend):
    """V = 0: weight (0, H) (with a (0,) bias / class weights, or none) -> ValueError naming V."""
    hidden, _, _, _ = _good()
    for target in (torch.full((ROWS,), -100), torch.zeros(ROWS, dtype=torch.int64)):
        weight = torch.zeros(0, H, requires_grad=True)
        assert "V = 0" in _raises(ValueError, backend, hidden, weight, target)
        assert "V = 0" in _raises(ValueError, backend, hidden, weight, target, torch.zeros(0),
                                  ce_weight=torch.ones(0))


def test_zero_hidden_size(backend):
    """H = 0: hidden (..., 0) with weight (V, 0), or either alone -> ValueError naming H."""
    hidden, weight, bias, target = _good()
    h0, w0 = torch.zeros(ROWS, 0, requires_grad=True), torch.zeros(V, 0, requires_grad=True)
    for h, w in ((h0, w0), (h0, weight), (hidden, w0), (torch.zeros(2, 5, 0), w0)):
        msg = _raises(ValueError, backend, h, w, target.reshape(h.shape[:-1]), bias)
        assert "H = 0" in msg, msg


def test_a_transposed_head_gets_a_layout_hint():
    """A fresh user's finding: ``linear_cross_entropy(h, W.T, t)`` said only that the sizes differ."""
    hidden, weight, target = torch.randn(4, 6), torch.randn(20, 6), torch.randint(0, 20, (4,))
    for call in (lambda: fusedce.linear_cross_entropy(hidden, weight.T, target),
                 lambda: fusedce.linear_token_log_probs(hidden, weight.T, target),
                 lambda: fusedce.linear_distillation_loss(hidden, weight.T, hidden, weight, target)):
        with pytest.raises(ValueError, match="looks transposed: the LM head is \\(V, H\\)"):
            call()


@pytest.mark.parametrize("op", ["function", "module", "linear"])
def test_a_negative_z_loss_coefficient_is_refused(op):
    """A fresh user's finding: ``lse_square_scale=-1`` gave a loss of -8 (a negative z-loss rewards a large lse)."""
    logits, target = torch.randn(4, 9), torch.randint(0, 9, (4,))
    calls = {"function": lambda: fusedce.cross_entropy(logits, target, lse_square_scale=-1.0),
             "module": lambda: fusedce.LinearCrossEntropyLoss(lse_square_scale=-1.0),
             "linear": lambda: fusedce.linear_cross_entropy(torch.randn(4, 3), torch.randn(9, 3), target,
                                                            lse_square_scale=-1e-4)}
    with pytest.raises(ValueError, match="lse_square_scale must be >= 0"):
        calls[op]()


@pytest.mark.parametrize("pair", [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                  (torch.bfloat16, torch.float16)], ids=["fp32_fp16", "fp32_bf16", "bf16_fp16"])
def test_accum_dtype_narrower_than_the_weight(backend, pair):
    """An ``accum_dtype`` narrower than the weight's (fp16 sums of an fp32 gradient overflow to inf where
    the fp32 result fits): ValueError naming both dtypes, before anything is computed; the same or a wider
    one is accepted."""
    dtype, accum = pair
    hidden, weight, _, target = _good()
    hidden, weight = hidden.detach().to(dtype), weight.detach().to(dtype).requires_grad_()
    with pytest.raises(ValueError, match=f"accum_dtype {accum} is narrower than weight's {dtype}"):
        fusedce.linear_cross_entropy(hidden, weight, target, backend=backend, accum_dtype=accum)
    assert weight.grad is None
    for ok in (dtype, torch.float64):
        fusedce.linear_cross_entropy(hidden, weight, target, backend=backend, accum_dtype=ok).backward()


def test_logits_passed_as_hidden_are_named_as_such():
    """A fresh user's finding: logits (..., V) given as hidden were called a transposed head, though the head
    (V, H) was right; a head has more rows than columns, which tells the two mistakes apart."""
    hidden, weight, target = torch.randn(4, 6), torch.randn(20, 6), torch.randint(0, 20, (4,))
    logits = hidden @ weight.T
    for call in (lambda: fusedce.linear_cross_entropy(logits, weight, target),
                 lambda: fusedce.linear_token_log_probs(logits, weight, target)):
        with pytest.raises(ValueError, match=r"hidden looks like logits \(\.\.\., V = 20\)") as info:
            call()
        assert "transposed" not in str(info.value)
