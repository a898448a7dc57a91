"""Every option of ``fusedce.cross_entropy`` alone and combined, every logits dtype, both index dtypes,
odd vocabulary sizes, several row counts, 0-3 leading dims and non-trivial strides, against the float64
reference (reference64.py) with the tolerance table (tolerances.py). Allocations are poisoned
(inputs.poisoned_allocations) so that an unwritten output element fails."""
import pytest
import torch

import fusedce

from inputs import (DTYPE_IDS, DTYPES, INDEX_DTYPES, INDEX_IDS, bit_identical, check_against_reference, make_logits,
                    make_target, make_weight)

# ---------------------------------------------------------------------------------------------------
# The option matrix: (9, 1000). 9 rows: odd, not a multiple of any row block, rows 1, 4, 7 ignored;
# V = 1000: not a power of two, so the last vocabulary block is partial.
MATRIX_ROWS, MATRIX_V = 9, 1000

# name -> (options, logits scale, ignore every k-th row, with class weights)
OPTIONS = {
    "plain": ({}, 2.0, 0, False),
    "ignore_-100": ({}, 2.0, 3, False),
    "ignore_-1": ({"ignore_index": -1}, 2.0, 3, False),
    # an ignore_index that is also a valid class: those rows are ignored, other classes are not
    "ignore_class_2": ({"ignore_index": 2}, 2.0, 3, False),
    "smoothing_0.1": ({"label_smoothing": 0.1}, 2.0, 3, False),
    "smoothing_1.0": ({"label_smoothing": 1.0}, 2.0, 3, False),       # boundary: only the smooth term
    "zloss_1e-2": ({"lse_square_scale": 1e-2}, 2.0, 3, False),         # large enough to change the loss
    "softcap_30": ({"softcap": 30.0}, 40.0, 3, False),                 # |x| ~ 40: tanh saturates
    "softcap_2": ({"softcap": 2.0}, 2.0, 3, False),                    # small cap, chain rule dominant
    "weight": ({}, 2.0, 3, True),
    "num_items_int": ({"num_items_in_batch": 37}, 2.0, 3, False),
    "num_items_tensor": ({"num_items_in_batch": torch.tensor(29)}, 2.0, 3, False),
    "inplace_backward": ({"inplace_backward": True}, 2.0, 3, False),
    "return_stats": ({"return_stats": True}, 2.0, 3, False),
    "smoothing+weight": ({"label_smoothing": 0.2}, 2.0, 3, True),     # F.cross_entropy's weighted smoothing
    "zloss+softcap": ({"lse_square_scale": 1e-2, "softcap": 5.0}, 8.0, 3, False),
    "all_loss_options": ({"ignore_index": -1, "label_smoothing": 0.1, "lse_square_scale": 1e-2,
                          "softcap": 30.0}, 40.0, 3, True),
    "everything": ({"ignore_index": -1, "label_smoothing": 0.1, "lse_square_scale": 1e-2, "softcap": 30.0,
                    "num_items_in_batch": torch.tensor(11), "inplace_backward": True,
                    "return_stats": True}, 40.0, 3, True),
}


def _inputs(shape, n_classes, dtype, name, index_dtype=torch.int64):
    opts, scale, ignore_every, with_weight = OPTIONS[name]
    x = make_logits((*shape, n_classes), dtype, scale)
    t = make_target(shape, n_classes, index_dtype, ignore_every, opts.get("ignore_index", -100))
    w = make_weight(n_classes) if with_weight else None
    return x, t, w, dict(opts)


def _upstream(reduction, shape):
    """A non-unit upstream gradient: a scalar for mean/sum, a random per-token one for "none"."""
    return torch.randn(shape) if reduction == "none" else 3.7


REDUCTIONS = ("mean", "sum", "none")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_matrix_fp32(backend, name, reduction):
    """Every option (alone and combined) x every reduction, fp32 logits."""
    x, t, w, opts = _inputs((MATRIX_ROWS,), MATRIX_V, torch.float32, name)
    check_against_reference(x, t, w, backend=backend, reduction=reduction,
                            upstream=_upstream(reduction, t.shape), **opts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_matrix_low_precision(backend, name, dtype):
    """Every option with bf16 / fp16 logits; the reduction rotates over the options (the reductions do
    not depend on the dtype: they act on the fp32 per-row loss, fully crossed in fp32 above)."""
    reduction = REDUCTIONS[(list(OPTIONS).index(name) + (dtype == torch.float16)) % 3]
    x, t, w, opts = _inputs((MATRIX_ROWS,), MATRIX_V, dtype, name)
    check_against_reference(x, t, w, backend=backend, reduction=reduction,
                            upstream=_upstream(reduction, t.shape), **opts)


def test_options_change_the_loss():
    """Guards the matrix above against vacuity: on its data every option moves the reference loss."""
    from reference64 import reference_cross_entropy as ref
    x, t, w, _ = _inputs((MATRIX_ROWS,), MATRIX_V, torch.float32, "plain")
    base = float(ref(x, t).loss)
    for kw in ({"label_smoothing": 0.1}, {"lse_square_scale": 1e-2}, {"softcap": 2.0},
               {"num_items_in_batch": 37}, {"ignore_index": int(t[4])}):
        assert abs(float(ref(x, t, **kw).loss) - base) > 1e-3 * abs(base), kw
    assert abs(float(ref(x, t, make_weight(MATRIX_V)).loss) - base) > 1e-3 * abs(base)


# ---------------------------------------------------------------------------------------------------
# Vocabulary sizes, rows kept small for the big ones (the Triton interpreter's cost is per program,
# i.e. per row and vocabulary block): rows x V ~ 5e4 - 2.5e5.
VOCABS = {
    "V3_tiny": (19, 3),            # smaller than any block; 19 rows: odd
    "V1000_partial_block": (24, 1000),
    "V32001_llama2_plus1": (8, 32001),   # one past a power-of-two multiple: a 1-element last block
    "V50257_gpt2": (5, 50257),           # GPT-2's odd vocabulary
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("config", ["plain-mean", "all-none"])
@pytest.mark.parametrize("vocab", list(VOCABS))
def test_vocab_sizes(backend, vocab, config, dtype):
    rows, n_classes = VOCABS[vocab]
    name, reduction = ("plain", "mean") if config == "plain-mean" else ("all_loss_options", "none")
    x, t, w, opts = _inputs((rows,), n_classes, dtype, name)
    check_against_reference(x, t, w, backend=backend, reduction=reduction,
                            upstream=_upstream(reduction, t.shape), **opts)


# Row counts around typical row-block boundaries (1 row, 2, 31/32/33 around 32, 65 just past 64).
@pytest.mark.parametrize("rows", [1, 2, 31, 32, 33, 65])
def test_row_counts(backend, rows):
    x, t, w, opts = _inputs((rows,), 100, torch.float32, "all_loss_options")
    check_against_reference(x, t, w, backend=backend, reduction="none", upstream=torch.randn(rows), **opts)
    x, t, w, opts = _inputs((rows,), 100, torch.float32, "ignore_-100")
    check_against_reference(x, t, w, backend=backend, reduction="mean", **opts)


# Leading shapes: () (a single row, 0-dim target), 1-D, 2-D (batch, time), 3-D; V = 257 = 2^8 + 1.
LEADING = {"0d": (), "1d": (7,), "2d": (3, 5), "3d": (2, 3, 4)}


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=INDEX_IDS.get)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("lead", list(LEADING))
def test_leading_shapes_and_index_dtypes(backend, lead, dtype, reduction, index_dtype):
    shape = LEADING[lead]
    name = "ignore_-100" if len(shape) else "plain"   # a lone row must not be ignored to mean anything
    x, t, w, opts = _inputs(shape, 257, dtype, name, index_dtype)
    _, loss, _ = check_against_reference(x, t, w, backend=backend, reduction=reduction,
                                         upstream=_upstream(reduction, shape), **opts)
    assert tuple(loss.shape) == (shape if reduction == "none" else ())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=INDEX_IDS.get)
def test_index_dtypes_with_weights(backend, index_dtype, dtype):
    x, t, w, opts = _inputs((24,), 1000, dtype, "all_loss_options", index_dtype)
    check_against_reference(x, t, w, backend=backend, reduction="mean", **opts)


def test_class_one_vocabulary(backend):
    """V = 1: lse = z, the loss is 0 (or the z-loss alone) and the gradient is 0 (or the z-loss's)."""
    x = make_logits((6, 1), torch.float32)
    t = torch.tensor([0, 0, -100, 0, 0, 0])
    check_against_reference(x, t, backend=backend, reduction="none", upstream=torch.randn(6),
                            lse_square_scale=0.1)


# ---------------------------------------------------------------------------------------------------
# Strides. The NaN padding around each view would reach the result if a kernel read past its row's V
# columns or past the last row; it must also still be NaN after backward (nothing written outside).
NAN = float("nan")


def _padded(rows, n_classes, dtype, pad_cols=24, pad_rows=3, scale=2.0):
    """A leaf (rows + 6, V + 24) buffer, NaN except the (rows, V) window returned with it."""
    buf = torch.full((rows + 2 * pad_rows, n_classes + pad_cols), NAN, dtype=dtype)
    window = (slice(pad_rows, pad_rows + rows), slice(0, n_classes))
    buf[window] = make_logits((rows, n_classes), dtype, scale, requires_grad=False)
    return buf.requires_grad_(True), window


@pytest.mark.parametrize("inplace", [False, True], ids=["copy_grad", "inplace_backward"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_row_stride_wider_than_v(backend, dtype, inplace):
    """logits = a (rows, V) window of a wider NaN-padded buffer: row stride V + 24, storage offset."""
    rows, n_classes = 9, 1000
    buf, window = _padded(rows, n_classes, dtype)
    before = buf.detach().clone()
    x = buf[window]
    assert x.stride(0) == n_classes + 24 and x.storage_offset() > 0
    t = make_target((rows,), n_classes, ignore_every=4)
    w = make_weight(n_classes)
    _, _, grad = check_against_reference(x, t, w, backend=backend, reduction="sum", label_smoothing=0.1,
                                         inplace_backward=inplace)
    outside = torch.ones(buf.shape, dtype=torch.bool)
    outside[window] = False
    assert bool(torch.isnan(buf.detach()[outside]).all()), "something was written outside the logits window"
    if inplace:
        assert grad.data_ptr() == x.data_ptr(), "inplace_backward: the gradient must live in logits' storage"
    else:
        assert bit_identical(buf.detach(), before), "inplace_backward=False modified the caller's buffer"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_3d_view_with_padded_rows(backend, dtype):
    """(B, T, V) window of a (B, T, V + 24) buffer: the rows merge into one stride (a view, no copy)."""
    b, s, n_classes = 2, 5, 257
    buf = make_logits((b, s, n_classes + 24), dtype, requires_grad=False)
    buf[..., n_classes:] = NAN
    buf.requires_grad_(True)
    x = buf[..., :n_classes]
    t = make_target((b, s), n_classes, ignore_every=3)
    check_against_reference(x, t, backend=backend, reduction="none", upstream=torch.randn(b, s),
                            lse_square_scale=1e-2)
    check_against_reference(x, t, backend=backend, reduction="mean")


def test_3d_unmergeable_rows(backend):
    """(B, T, V) with every other time step of a (B, 2T, V) buffer: rows cannot merge (copied once)."""
    buf = make_logits((2, 10, 300), torch.float32)
    x = buf[:, ::2, :]
    t = make_target((2, 5), 300, ignore_every=3)
    check_against_reference(x, t, backend=backend, reduction="none", upstream=torch.randn(2, 5))


@pytest.mark.parametrize("inplace", [False, True], ids=["copy_grad", "inplace_backward"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_last_dim_not_stride_1(backend, dtype, inplace):
    """logits (BT, V) = the transpose of a (V, BT) tensor: last-dim stride BT (the contract copies once)."""
    leaf = make_logits((300, 11), dtype)
    x = leaf.t()
    assert x.stride(-1) != 1
    t = make_target((11,), 300, ignore_every=3)
    before = leaf.detach().clone()
    check_against_reference(x, t, backend=backend, reduction="mean", lse_square_scale=1e-2,
                            inplace_backward=inplace)
    if not inplace:
        assert bit_identical(leaf.detach(), before)


def test_inplace_backward_overlapping_rows(backend):
    """Rows that overlap in memory (an ``as_strided`` view, row stride 1 < V): an in-place backward
    would write several rows' gradients into one location, so the rows are copied once and the
    gradient reaching the base tensor is the reference's (before: relative error ~6e6)."""
    base = torch.randn(12, dtype=torch.float32, requires_grad=True)
    t = torch.tensor([0, 3, -100, 6, 2])
    up = torch.randn(5)
    grads = []
    for inplace in (False, True):
        x = (base * 1).as_strided((5, 7), (1, 1))
        loss = fusedce.cross_entropy(x, t, backend=backend, reduction="none", inplace_backward=inplace)
        (g,) = torch.autograd.grad(loss, base, up)
        grads.append(g)
    x64 = (base.detach().double() * 1).requires_grad_()
    ref = torch.nn.functional.cross_entropy(x64.as_strided((5, 7), (1, 1)), t, reduction="none")
    (g64,) = torch.autograd.grad(ref, x64, up.double())
    for g in grads:
        torch.testing.assert_close(g.double(), g64, rtol=1e-5, atol=1e-6)


def test_strided_target_and_weight(backend):
    """target and weight as every-other-element views (stride 2) of larger tensors."""
    n_classes = 500
    x = make_logits((16, n_classes), torch.float32)
    t_buf = make_target((32,), n_classes, ignore_every=3)
    t_buf[1::2] = n_classes + 7  # out of range: reading them through a wrong stride gives an error/NaN
    t = t_buf[::2]
    w = make_weight(2 * n_classes)[::2]
    assert t.stride(0) == 2 and w.stride(0) == 2
    check_against_reference(x, t, w, backend=backend, reduction="mean", label_smoothing=0.1)


# ---------------------------------------------------------------------------------------------------
# bf16 / fp16 gradients judged against PyTorch's own error at the same dtype (F.cross_entropy on the
# same low-precision logits, class dim last = dim 1 for 2-D), with the factor case C6 sets (4x; see
# tolerances.TORCH_LOW_PRECISION_FACTOR). Measured on this data, the torch backend is 0.2x-1.0x torch's.
@pytest.mark.parametrize("config", ["plain", "smoothing_0.1", "weight"])
@pytest.mark.parametrize("n_classes", [1000, 32001])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
def test_low_precision_error_vs_torch(backend, dtype, n_classes, config):
    import torch.nn.functional as F
    from inputs import loss_and_grad
    from reference64 import reference_cross_entropy
    from tolerances import TORCH_LOW_PRECISION_FACTOR
    x, t, w, opts = _inputs((8,), n_classes, dtype, config)
    ref = reference_cross_entropy(x, t, w, **opts)
    _, grad = loss_and_grad(x, t, w, backend=backend, **opts)
    xs = x.detach().clone().requires_grad_()
    (stock,) = torch.autograd.grad(F.cross_entropy(xs, t, None if w is None else w.to(dtype), **opts), xs)
    ours_err = float((grad.double() - ref.grad).norm())
    torch_err = float((stock.double() - ref.grad).norm())
    assert ours_err <= TORCH_LOW_PRECISION_FACTOR * torch_err, (
        f"grad error (Frobenius) {ours_err:.3e} vs torch's own {DTYPE_IDS[dtype]} {torch_err:.3e}")
