"""``linear_cross_entropy(..., method="tiled")``: every option and reduction against the float64
``F.linear`` + ``F.cross_entropy`` composition (reference64_linear.py, allocations poisoned), for both
backends, with tile sizes that divide nothing; the allocation contract (no tensor of V or more elements
besides weight, bias, class weights and their gradients); the method argument's errors.

The PyTorch backend's tiles are shrunk here (``tiny_tiles``) so that every test crosses several token
and vocabulary tiles, partial ones included; the Triton kernels' tile sizes are their own (their
tests: test_triton_tiled.py).
"""
import pytest
import torch

import fusedce
from fusedce.backends.pytorch import tuning as torch_tuning
from inputs import DTYPE_IDS, make_target, make_weight
from reference64_linear import check_linear, make_linear
from op_recorder import OpRecorder
from linear_options import OPTIONS, _upstream

ROWS, HIDDEN, V = 13, 16, 1000


@pytest.fixture(autouse=True)
def tiny_tiles(monkeypatch):
    """5 token rows x 96 classes per PyTorch tile: 13 rows = 5 + 5 + 3, V = 1000 = 10 x 96 + 40."""
    monkeypatch.setattr(torch_tuning, "TILE_ROWS", 5)
    monkeypatch.setattr(torch_tuning, "TILE_VOCAB", 96)


def _case(name, lead=(ROWS,), n_classes=V, dtype=torch.float32):
    opts, scale, ignore_every, with_weight = OPTIONS[name]
    hidden, weight, bias = make_linear(lead, HIDDEN, n_classes, dtype, bias=True, logit_scale=scale)
    target = make_target(lead, n_classes, torch.int64, ignore_every, opts.get("ignore_index", -100))
    return hidden, weight, bias, target, dict(opts, ce_weight=make_weight(n_classes) if with_weight else None)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_matrix_tiled(backend, name, reduction):
    hidden, weight, bias, target, opts = _case(name)
    check_linear(hidden, weight, target, bias, backend=backend, reduction=reduction, method="tiled",
                 upstream=_upstream(reduction, target.shape), **opts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
def test_low_precision_tiled(backend, dtype):
    hidden, weight, bias, target, opts = _case("everything", (3, 6), 512, dtype)
    check_linear(hidden, weight, target, bias, backend=backend, reduction="none", method="tiled",
                 upstream=torch.randn(target.shape), **opts)


def test_tiled_matches_chunked_and_auto(backend):
    """The same loss, stats and gradients (to fp32 rounding) from both methods; "auto" is chunked."""
    hidden, weight, bias, target, opts = _case("everything")
    results = {}
    for method in ("chunked", "tiled", "auto"):
        h, w, b = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
        out = fusedce.linear_cross_entropy(h, w, target, b, backend=backend, method=method, **opts)
        out.loss.backward()
        results[method] = (out, h.grad, w.grad, b.grad)
    (c, *gc), (t, *gt), (a, *ga) = results["chunked"], results["tiled"], results["auto"]
    torch.testing.assert_close(t.loss, c.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(t.lse, c.lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(t.predicted_tokens, c.predicted_tokens)
    for x, y in zip(gt, gc):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)
    assert torch.equal(a.loss, c.loss) and all(torch.equal(x, y) for x, y in zip(ga, gc))


def test_all_ignored_and_empty(backend):
    for lead in ((4,), (0,)):
        hidden, weight, bias = make_linear(lead, HIDDEN, 300, bias=True)
        target = torch.full(lead, -100, dtype=torch.int64)
        out = fusedce.linear_cross_entropy(hidden, weight, target, bias, backend=backend, method="tiled",
                                           return_stats=True)
        assert out.loss.item() == 0.0
        out.loss.backward()
        assert bool((hidden.grad == 0).all()) and bool((weight.grad == 0).all()) and bool((bias.grad == 0).all())


def test_all_minus_inf_vocabulary_tiles(backend):
    """A bias of -inf over whole vocabulary tiles (masked classes): those tiles add exactly 0."""
    hidden, weight, bias = make_linear((7,), HIDDEN, 300, bias=True)
    with torch.no_grad():
        bias[:200] = float("-inf")
    target = torch.randint(200, 300, (7,))
    out = fusedce.linear_cross_entropy(hidden, weight, target, bias.detach(), backend=backend, method="tiled",
                                       reduction="none")
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden.double(), weight.double(),
                                                                       bias.detach().double()),
                                            target, reduction="none")
    assert not bool(out.isnan().any())
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert bool(hidden.grad.isfinite().all()) and bool(weight.grad[:200].eq(0).all())


# ---------------------------------------------------------------------------------------------------
# Allocations: torch BT=64, H=16, V=2000 (tiles 5 x 96 = 480 < V); triton (interpreter) BT=24, H=16,
# V=600 with its own tiles. Allowed at V elements or more: V x H (the weight gradient and its
# accumulator; the interpreter's copies of weight arguments) and V (bias gradient, class weights).
SHAPES = {"torch": (64, 16, 2000), "triton": (24, 16, 600)}


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_tensor_of_v_elements(backend, reduction):
    bt, n_hidden, n_classes = SHAPES[backend]
    hidden, weight, bias = make_linear((bt,), n_hidden, n_classes, bias=True)
    target = make_target((bt,), n_classes, ignore_every=5)
    rec = OpRecorder()
    with rec:
        out = fusedce.linear_cross_entropy(hidden, weight, target, bias, backend=backend, method="tiled",
                                           reduction=reduction, return_stats=True, label_smoothing=0.1,
                                           lse_square_scale=1e-2, softcap=30.0, ce_weight=make_weight(n_classes))
        out.loss.backward(torch.randn(out.loss.shape) if reduction == "none" else None)
    allowed = {n_classes * n_hidden, n_classes}
    big = [n for n in rec.sizes if n >= n_classes and n not in allowed]
    assert not big, f"allocations of V = {n_classes} or more elements: {sorted(set(big))}"
    assert hidden.grad is not None and weight.grad is not None and bias.grad is not None


DEFAULT_TILES = (torch_tuning.TILE_ROWS, torch_tuning.TILE_VOCAB)


@pytest.mark.parametrize("n_classes", [2, 7, 1000, 3001])
def test_default_tiles_stay_below_v(monkeypatch, n_classes):
    """With the shipped tile sizes (not this file's tiny ones): every block holds fewer than V logits,
    also when V is smaller than one vocabulary tile."""
    monkeypatch.setattr(torch_tuning, "TILE_ROWS", DEFAULT_TILES[0])
    monkeypatch.setattr(torch_tuning, "TILE_VOCAB", DEFAULT_TILES[1])
    rows, vocab = torch_tuning.tile_sizes(n_classes)
    assert rows * vocab < n_classes and vocab < n_classes
    if n_classes < 100:   # the O(BT) row statistics of 12 tokens would be >= V themselves
        return
    hidden, weight, bias = make_linear((12,), 4, n_classes, bias=True)
    target = make_target((12,), n_classes, ignore_every=5)
    rec = OpRecorder()
    with rec:
        fusedce.linear_cross_entropy(hidden, weight, target, bias, backend="torch", method="tiled",
                                     label_smoothing=0.1).backward()
    big = [n for n in rec.sizes if n >= n_classes and n not in (n_classes * 4, n_classes)]
    assert not big, f"allocations of V = {n_classes} or more elements: {sorted(set(big))}"


def test_chunked_premise_allocates_logits():
    """The recorder sees a chunk of logits (>= V elements) on the chunked path: the check above can fail."""
    hidden, weight, bias = make_linear((64,), 16, 2000, bias=True)
    target = make_target((64,), 2000)
    rec = OpRecorder()
    with rec:
        fusedce.linear_cross_entropy(hidden, weight, target, bias, backend="torch", method="chunked").backward()
    assert rec.largest >= 64 * 2000


# ---------------------------------------------------------------------------------------------------
def test_method_errors():
    hidden, weight, _ = make_linear((4,), HIDDEN, 50)
    target = make_target((4,), 50)
    with pytest.raises(ValueError, match="method"):
        fusedce.linear_cross_entropy(hidden, weight, target, method="blocked")
    with pytest.raises(ValueError, match="chunk_size"):
        fusedce.linear_cross_entropy(hidden, weight, target, method="tiled", chunk_size=4)
    with pytest.raises(ValueError, match="method"):
        fusedce.LinearCrossEntropyLoss(method="fast")
    with pytest.raises(ValueError, match="chunk_size"):
        fusedce.LinearCrossEntropyLoss(chunk_size=8, method="tiled")
    loss = fusedce.LinearCrossEntropyLoss(method="tiled")(hidden, weight, target)
    torch.testing.assert_close(loss, fusedce.linear_cross_entropy(hidden, weight, target), rtol=1e-5, atol=1e-6)
