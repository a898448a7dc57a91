"""Vocab-parallel cross-entropy (``fusedce.distributed``) against the single-process losses, on CPU/gloo.

How it runs: for each world size (2 and 3) the process group is spawned ONCE (``dist_harness.results``: processes on
127.0.0.1, a free TCP port) and every rank runs every check of ``CHECKS`` in turn, recording a traceback
per failing check instead of stopping; each pytest test then reads one check's outcome. Under
pytest-xdist the spawn happens once per world size for the whole session (a file lock in the session's
shared temp dir), whichever worker gets there first.

Every check builds the full inputs from the same seed on every rank, gives each rank its slice of the
vocabulary, and compares with (a) the float64 oracle (reference64.py) under the contract's tolerance
table (tolerances.py) and (b) ``fusedce.cross_entropy(backend="torch")`` / ``fusedce.linear_cross_entropy``
within twice that bound (both are within the bound of the oracle).

Shapes: V = 17 classes split unevenly, 7 + 10 over 2 ranks and 5 + 1 + 11 over 3 (a one-class slice);
(3, 5) = 15 tokens (odd, 2 leading dims), every 4th row ignored, target 0 in row 0 and V - 1 (the last
rank's last column) in row 2; H = 12 for the linear op, chunk_size None (one chunk) and 4 (11 kept rows:
a partial last chunk).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedce
import fusedce.distributed as fd
from fusedce.distributed.argmax_key import pack_max_key, unpack_max_key
from dist_harness import assert_passed, over_worlds, results
from inputs import make_logits, make_target, make_weight
from reference64 import reference_cross_entropy
from tolerances import FP32_UNITS, LINEAR_MAX_RTOL, TOLERANCES, U32

V, SHAPE, H = 17, (3, 5), 12
INF = float("inf")
SIZES = {2: (7, 10), 3: (5, 1, 11)}
REDUCTIONS = ("mean", "sum", "none")
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


# ---------------------------------------------------------------------------------------- helpers
def _slice(rank, sizes):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _within(name, actual, expected, bound):
    """|actual - expected| <= bound elementwise (float64), the same NaN pattern and shape."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.equal(a.isnan(), e.isnan()), f"{name}: NaN pattern differs"
    diff = torch.where(e.isnan(), 0.0, (a - e).abs())
    bad = diff > torch.broadcast_to(torch.as_tensor(bound, dtype=torch.float64), e.shape)
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} elements off, max |diff| {float(diff.max()):.3e}"


def _near(name, actual, expected, rtol=LINEAR_MAX_RTOL):
    """Norm-relative closeness for the linear op: |a - e| <= rtol (|e| + max |e|). The logits are an
    H-term dot product and the hidden gradient a V-term one, rounded in fp32 in another order than the
    float64 oracle: a few hundred fp32 ulps of the largest element at most, 2^-16 = 512 ulps."""
    e = expected.detach().double()
    _within(name, actual, e, rtol * (e.abs() + e.abs().max().clamp_min(1e-30)))


def _upstream_for(loss, upstream):
    if upstream is None:
        return torch.ones_like(loss)
    if isinstance(upstream, torch.Tensor):
        return upstream
    return torch.full_like(loss, float(upstream))


def _upstream(reduction):
    return torch.randn(SHAPE) if reduction == "none" else 3.7


def _split(out):
    return (out.loss, out) if isinstance(out, fusedce.CrossEntropyOutput) else (out, None)


def run_ce(rank, x, t, w, sizes, upstream=None, starts=None, **kw):
    """vocab_parallel_cross_entropy on this rank's slice vs the oracle and the torch backend."""
    cols = slice(starts[rank], starts[rank] + sizes[rank]) if starts else _slice(rank, sizes)
    xs = x.detach()[..., cols].clone().requires_grad_()
    ws = None if w is None else w[cols]
    out = fd.vocab_parallel_cross_entropy(xs, t, ws, vocab_start_index=starts[rank] if starts else None, **kw)
    loss, stats = _split(out)
    (grad,) = torch.autograd.grad(loss, xs, _upstream_for(loss, upstream))

    ref_kw = {k: v for k, v in kw.items() if k != "return_stats"}
    ref = reference_cross_entropy(x, t, w, upstream=upstream, **ref_kw)
    xt = x.detach().clone().requires_grad_()
    single_loss, single = _split(fusedce.cross_entropy(xt, t, w, backend="torch", **kw))
    (single_grad,) = torch.autograd.grad(single_loss, xt, _upstream_for(single_loss, upstream))

    tol = TOLERANCES[x.dtype]
    assert loss.dtype == torch.float32 and grad.dtype == x.dtype and grad.shape == xs.shape
    loss_bound = tol.loss_rtol * ref.loss.abs() + FP32_UNITS * U32 * ref.loss_err_scale
    _within("loss vs float64", loss, ref.loss, loss_bound)
    _within("loss vs single-process", loss, single_loss, 2 * loss_bound)
    g_ref = ref.grad[..., cols]
    grad_bound = tol.grad_rtol * g_ref.abs() + FP32_UNITS * U32 * ref.grad_err_scale + tol.grad_atol
    _within("grad vs float64", grad, g_ref, grad_bound)
    _within("grad vs single-process", grad, single_grad[..., cols], 2 * grad_bound)
    if stats is not None:
        lse_bound = FP32_UNITS * U32 * ref.row_mag
        _within("lse vs float64", stats.lse, ref.lse, lse_bound)
        _within("lse vs single-process", stats.lse, single.lse, 2 * lse_bound)
        _within("z_loss", stats.z_loss, ref.z_loss, 2 * loss_bound)
        assert torch.equal(stats.predicted_tokens, ref.predicted), "predicted_tokens vs float64"
        assert torch.equal(stats.predicted_tokens, single.predicted_tokens), "predicted_tokens"
        assert torch.equal(stats.token_accuracy, single.token_accuracy), "token_accuracy"
    return loss, grad, stats


def run_linear(rank, h, W, t, b, cw, sizes, upstream=None, **kw):
    """vocab_parallel_linear_cross_entropy vs the float64 F.linear + cross-entropy composition and
    fusedce.linear_cross_entropy; returns the distributed (loss, grads, stats)."""
    cols = _slice(rank, sizes)
    hd = h.detach().clone().requires_grad_()
    leaves = [hd, W.detach()[cols].clone().requires_grad_()]
    if b is not None:
        leaves.append(b.detach()[cols].clone().requires_grad_())
    out = fd.vocab_parallel_linear_cross_entropy(hd, leaves[1], t, leaves[2] if b is not None else None,
                                                 ce_weight_shard=None if cw is None else cw[cols], **kw)
    loss, stats = _split(out)
    grads = torch.autograd.grad(loss, leaves, _upstream_for(loss, upstream))
    for leaf, g in zip(leaves, grads):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape

    ref_kw = {k: v for k, v in kw.items() if k not in ("return_stats", "chunk_size", "accum_dtype")}
    h64, W64 = h.detach().double(), W.detach().double()
    logits64 = F.linear(h64, W64, None if b is None else b.detach().double())
    ref = reference_cross_entropy(logits64, t, cw, upstream=upstream, **ref_kw)
    g64 = ref.grad.reshape(-1, W.shape[0])
    expected = [ref.grad @ W64, (g64.T @ h64.reshape(-1, h.shape[-1]))[cols], g64.sum(0)[cols]]
    # bf16: the logits are rounded to bf16 (2^-9 relative) as in F.linear; a few such roundings reach
    # the loss and gradients, so 2^-6 of the largest element (not the fp32 bound)
    rtol = LINEAR_MAX_RTOL if h.dtype == torch.float32 else 2.0 ** -6
    _near("loss vs float64", loss, ref.loss, rtol)
    for name, g, e in zip(("grad_hidden", "grad_weight", "grad_bias"), grads, expected):
        _near(f"{name} vs float64", g, e, rtol)

    single_leaves = [x.detach().clone().requires_grad_() for x in (h, W, b) if x is not None]
    single_out = fusedce.linear_cross_entropy(*single_leaves[:2], t, single_leaves[2] if b is not None
                                              else None, ce_weight=cw, backend="torch", **kw)
    single_loss, single = _split(single_out)
    single_grads = torch.autograd.grad(single_loss, single_leaves, _upstream_for(single_loss, upstream))
    _near("loss vs single-process", loss, single_loss, rtol)
    for name, g, e in zip(("grad_hidden", "grad_weight", "grad_bias"), grads, single_grads):
        _near(f"{name} vs single-process", g, e if name == "grad_hidden" else e[cols], rtol)
    if stats is not None:
        assert torch.equal(stats.predicted_tokens, single.predicted_tokens), "predicted_tokens"
        assert torch.equal(stats.token_accuracy, single.token_accuracy), "token_accuracy"
        _near("lse vs single-process", stats.lse, single.lse, rtol)
        _near("z_loss vs single-process", stats.z_loss, single.z_loss, rtol)
    return loss, grads, stats


def _target(ignore_every=4, ignore_index=-100, dtype=torch.int64):
    """make_target, with V - 1 (the last rank's last column) also in row 2 (row 1 is ignored)."""
    t = make_target(SHAPE, V, dtype, ignore_every, ignore_index)
    t.view(-1)[2] = V - 1
    return t


def _ce_inputs(dtype=torch.float32, scale=2.0):
    return make_logits((*SHAPE, V), dtype, scale, requires_grad=False), _target()


def _linear_inputs(dtype=torch.float32):
    h = (torch.randn(*SHAPE, H)).to(dtype)
    W = (torch.randn(V, H) * H ** -0.5 * 2.0).to(dtype)
    b = (torch.randn(V) * 0.5).to(dtype)
    return h, W, b, _target()


# ----------------------------------------------------------------------------------------- checks
# Each check runs on every rank with the same random inputs; it raises on failure.
@check
def ce_reductions(rank, world):
    """Every reduction, "none" with a per-token upstream gradient, targets 0 and V-1, ignored rows."""
    x, t = _ce_inputs()
    assert int(t.reshape(-1)[2]) == V - 1   # owned by the last rank's last column
    # premise: the vocab-parallel ops really run on the backend under test
    assert fusedce.backends.resolve(None, x.device) == os.environ["FUSEDCE_BACKEND"]
    for reduction in REDUCTIONS:
        run_ce(rank, x, t, None, SIZES[world], upstream=_upstream(reduction), reduction=reduction)


OPTIONS = {  # name -> (options, logits scale, class weights)
    "smoothing": ({"label_smoothing": 0.1}, 2.0, False),
    "smoothing_1": ({"label_smoothing": 1.0}, 2.0, False),
    "zloss": ({"lse_square_scale": 1e-2}, 2.0, False),
    "softcap": ({"softcap": 5.0}, 8.0, False),
    "weights": ({}, 2.0, True),
    "weights+smoothing": ({"label_smoothing": 0.2}, 2.0, True),
    "num_items_int": ({"num_items_in_batch": 37}, 2.0, False),
    "num_items_tensor": ({"num_items_in_batch": torch.tensor(29)}, 2.0, True),
    "num_items_0": ({"num_items_in_batch": 0}, 2.0, False),
    "ignore_class_2": ({"ignore_index": 2}, 2.0, True),
    "everything": ({"ignore_index": -1, "label_smoothing": 0.1, "lse_square_scale": 1e-2, "softcap": 30.0,
                    "num_items_in_batch": torch.tensor(11), "return_stats": True}, 40.0, True),
}


@check
def ce_options(rank, world):
    """Each loss option alone and combined, with "mean" and "none" (and "sum" for the full mix)."""
    for name, (opts, scale, weighted) in OPTIONS.items():
        x = make_logits((*SHAPE, V), torch.float32, scale, requires_grad=False)
        t = _target(ignore_index=opts.get("ignore_index", -100))
        w = make_weight(V) if weighted else None
        for reduction in (("mean", "sum", "none") if name == "everything" else ("mean", "none")):
            try:
                run_ce(rank, x, t, w, SIZES[world], upstream=_upstream(reduction), reduction=reduction,
                       **opts)
            except AssertionError as e:
                raise AssertionError(f"{name}/{reduction}: {e}") from e


@check
def ce_case_c10(rank, world):
    """C10: V = 8 split 4 + 4 over 2 ranks (4 + 2 + 2 over 3), 6 tokens, label_smoothing = 0.1."""
    sizes = {2: (4, 4), 3: (4, 2, 2)}[world]
    x = make_logits((6, 8), requires_grad=False)
    t = torch.tensor([0, 7, 3, 4, -100, 5])
    loss, _, _ = run_ce(rank, x, t, None, sizes, label_smoothing=0.1)
    single = fusedce.cross_entropy(x, t, label_smoothing=0.1, backend="torch")
    loss, single = float(loss.detach()), float(single)
    assert abs(loss - single) <= 1e-6 * abs(single), (loss, single)


@check
def ce_all_ignored(rank, world):
    """C2 over ranks: every target ignored -> loss 0.0, gradient all zeros, no NaN, predicted -1."""
    x, _ = _ce_inputs()
    t = torch.full(SHAPE, -100)
    for w in (None, make_weight(V)):
        for reduction in REDUCTIONS:
            loss, grad, stats = run_ce(rank, x, t, w, SIZES[world], upstream=_upstream(reduction),
                                       reduction=reduction, label_smoothing=0.1, return_stats=True)
            assert not bool(loss.isnan().any()) and bool((loss == 0).all()), loss
            assert bool((grad == 0).all())
            assert bool((stats.predicted_tokens == -1).all()) and bool((stats.token_accuracy == 0).all())


@check
def ce_stats_ties(rank, world):
    """Global argmax with the max tied across slices: the lowest GLOBAL index wins (-0.0 == +0.0)."""
    sizes = SIZES[world]
    x = -1.0 - torch.rand(6, V)
    x[0, [2, V - 1]] = 3.0          # tie between the first and the last slice
    x[1, [V - 1, 8]] = 5.0          # tie inside one slice / across the middle
    x[2, 3], x[2, 12] = -0.0, 0.0   # signed zeros tie: index 3
    x[3, :] = 1.5                   # every class ties: index 0
    x[4, V - 1] = 9.0               # max at the last column of the last rank
    t = torch.tensor([2, 8, 3, 4, V - 1, -100])
    _, _, stats = run_ce(rank, x, t, None, sizes, return_stats=True, reduction="none")
    assert stats.predicted_tokens.tolist() == [2, 8, 3, 0, V - 1, -1], stats.predicted_tokens


@check
def ce_low_precision(rank, world):
    """bf16 and fp16 logits: fp32 loss, gradient in the logits' dtype within the table's bound."""
    for dtype in (torch.bfloat16, torch.float16):
        x, t = _ce_inputs(dtype)
        run_ce(rank, x, t, make_weight(V), SIZES[world], upstream=1.0, label_smoothing=0.1,
               lse_square_scale=1e-3, return_stats=True)


@check
def ce_layouts(rank, world):
    """Explicit vocab_start_index in an order unlike rank order, a rank holding no class, one holding one."""
    x, t = _ce_inputs()
    w = make_weight(V)
    orders = {2: ((10, 7), (7, 0)), 3: ((5, 4, 8), (12, 0, 4))}[world]   # sizes, starts
    run_ce(rank, x, t, w, orders[0], starts=orders[1], label_smoothing=0.1, return_stats=True)
    empty = {2: (17, 0), 3: (6, 0, 11)}[world]
    run_ce(rank, x, t, w, empty, label_smoothing=0.1, lse_square_scale=1e-2, return_stats=True)
    one = {2: (16, 1), 3: (5, 1, 11)}[world]   # a one-class slice (the Triton kernels run on 2 ranks only)
    run_ce(rank, x, t, w, one, label_smoothing=0.1, lse_square_scale=1e-2, return_stats=True)


@check
def ce_empty_and_strided(rank, world):
    """BT = 0 (0.0 / empty loss), and a non-contiguous (permuted) logits slice with 3 leading dims."""
    sizes, cols = SIZES[world], _slice(rank, SIZES[world])
    for reduction in REDUCTIONS:
        xs = torch.randn(0, cols.stop - cols.start, requires_grad=True)
        loss = fd.vocab_parallel_cross_entropy(xs, torch.zeros(0, dtype=torch.long), reduction=reduction)
        assert loss.shape == ((0,) if reduction == "none" else ()) and bool((loss == 0).all())
    x = make_logits((5, 2, 3, V), requires_grad=False).permute(1, 0, 2, 3)
    t = make_target(x.shape[:-1], V, torch.int32, ignore_every=3)
    run_ce(rank, x, t, None, sizes, upstream=torch.randn(t.shape), reduction="none", return_stats=True)


@check
def ce_inputs_untouched(rank, world):
    """C4: forward (no_grad) and forward + backward leave the caller's logits slice bit-identical."""
    x, t = _ce_inputs()
    xs = x[..., _slice(rank, SIZES[world])].clone()
    before = xs.clone()
    with torch.no_grad():
        fd.vocab_parallel_cross_entropy(xs, t, label_smoothing=0.1, softcap=5.0)
    xs.requires_grad_()
    fd.vocab_parallel_cross_entropy(xs, t, label_smoothing=0.1, softcap=5.0).backward()
    assert torch.equal(xs.detach(), before)


def _raises(exc, fn, *words):
    try:
        fn()
    except exc as e:
        for word in words:
            assert word in str(e), f"{exc.__name__} message {str(e)!r} lacks {word!r}"
        return
    raise AssertionError(f"no {exc.__name__} raised")


@check
def ce_errors(rank, world):
    """Errors of the contract; the target range is the GLOBAL V (a local id out of the slice is fine)."""
    sizes, cols = SIZES[world], _slice(rank, SIZES[world])
    xs = torch.randn(4, sizes[rank])
    ok = torch.tensor([0, sizes[0], V - 1, -100])          # sizes[0] is beyond rank 0's slice
    fd.vocab_parallel_cross_entropy(xs, ok)
    _raises(IndexError, lambda: fd.vocab_parallel_cross_entropy(xs, torch.tensor([0, 1, V, 2])),
            "[2]", str(V), f"V = {V}")
    _raises(IndexError, lambda: fd.vocab_parallel_cross_entropy(xs, torch.tensor([0, -1, 1, 2])), "-1")
    _raises(ValueError, lambda: fd.vocab_parallel_cross_entropy(xs, ok, reduction="avg"), "reduction")
    _raises(ValueError, lambda: fd.vocab_parallel_cross_entropy(xs, ok, torch.ones(V)), "weight_shard")
    _raises(ValueError, lambda: fd.vocab_parallel_cross_entropy(xs, ok[:3]), "shape")
    _raises(TypeError, lambda: fd.vocab_parallel_cross_entropy(xs.long(), ok))
    _raises(ValueError, lambda: fd.vocab_parallel_cross_entropy(xs, ok, vocab_start_index=0), "tile")
    some = 0 if rank == 0 else None
    _raises(ValueError, lambda: fd.vocab_parallel_cross_entropy(xs, ok, vocab_start_index=some), "every rank")
    assert cols.start >= 0


@check
def linear_reductions(rank, world):
    """Every reduction and chunking, with bias, ignored rows (compacted) and targets 0 / V-1."""
    h, W, b, t = _linear_inputs()
    for reduction in REDUCTIONS:
        for chunk_size in (None, 4):
            run_linear(rank, h, W, t, b, None, SIZES[world], upstream=_upstream(reduction),
                       reduction=reduction, chunk_size=chunk_size)


@check
def linear_options(rank, world):
    """Class weights, smoothing, z-loss, softcap, num_items_in_batch, stats; no bias; fp64 accumulators."""
    h, W, _, t = _linear_inputs()
    cw = make_weight(V)
    run_linear(rank, h, W, t, None, cw, SIZES[world], reduction="mean", label_smoothing=0.1,
               lse_square_scale=1e-2, softcap=3.0, chunk_size=4, return_stats=True)
    run_linear(rank, h, W, t, None, cw, SIZES[world], upstream=_upstream("none"), reduction="none",
               label_smoothing=0.2, return_stats=True)
    run_linear(rank, h, W, t, None, None, SIZES[world], upstream=0.5, num_items_in_batch=torch.tensor(7),
               accum_dtype=torch.float64, chunk_size=2)


@check
def linear_all_ignored(rank, world):
    """Every target ignored: loss 0.0 and all-zero gradients for hidden, weight and bias, no NaN."""
    h, W, b, _ = _linear_inputs()
    t = torch.full(SHAPE, -100)
    for reduction in REDUCTIONS:
        loss, grads, _ = run_linear(rank, h, W, t, b, make_weight(V), SIZES[world],
                                    upstream=_upstream(reduction), reduction=reduction, label_smoothing=0.1)
        assert bool((loss == 0).all()) and all(bool((g == 0).all()) for g in grads)


@check
def linear_low_precision_and_frozen(rank, world):
    """bf16 hidden / weight (gradients in bf16, fp32 accumulators); a frozen hidden (no all_reduce)."""
    h, W, b, t = _linear_inputs(torch.bfloat16)
    run_linear(rank, h, W, t, b, None, SIZES[world], label_smoothing=0.1, chunk_size=4)
    h, W, _, t = _linear_inputs()
    ws = W[_slice(rank, SIZES[world])].clone().requires_grad_()
    loss = fd.vocab_parallel_linear_cross_entropy(h, ws, t)
    loss.backward()
    W64 = W.double().requires_grad_()
    F.cross_entropy(F.linear(h.double(), W64).reshape(-1, V), t.reshape(-1)).backward()
    _near("grad_weight (frozen hidden)", ws.grad, W64.grad[_slice(rank, SIZES[world])])


@check
def linear_errors(rank, world):
    """Shape, dtype, chunk_size and global target-range errors of the linear op."""
    ws = torch.randn(SIZES[world][rank], H)
    h, t = torch.randn(4, H), torch.tensor([0, 1, 2, -100])
    lce = fd.vocab_parallel_linear_cross_entropy
    _raises(ValueError, lambda: lce(torch.randn(4, H + 1), ws, t), "weight_shard.shape[1]")
    _raises(TypeError, lambda: lce(h.half(), ws, t), "dtype")
    _raises(ValueError, lambda: lce(h, ws, t, torch.zeros(V)), "bias_shard")
    _raises(ValueError, lambda: lce(h, ws, t, chunk_size=0), "chunk_size")
    _raises(IndexError, lambda: lce(h, ws, torch.tensor([0, V, 1, 2])), f"V = {V}")


@check
def zero_sizes_and_wide_ignore_index(rank, world):
    """A global V = 0 (every slice empty) and H = 0 are ValueErrors on every rank (one rank's empty
    slice is fine: ce_layouts); an int32 target with ignore_index = 2**40 (0 in int32) ignores no row."""
    t = torch.tensor([0, 1, -100, 2])
    _raises(ValueError, lambda: fd.vocab_parallel_cross_entropy(torch.randn(4, 0), t), "V = 0")
    lce = fd.vocab_parallel_linear_cross_entropy
    _raises(ValueError, lambda: lce(torch.randn(4, H), torch.randn(0, H), t), "V = 0")
    _raises(ValueError, lambda: lce(torch.randn(4, 0), torch.randn(SIZES[world][rank], 0), t), "H = 0")
    _raises(ValueError, lambda: lce(torch.randn(4, H), torch.randn(SIZES[world][rank], 0), t), "H = 0")
    x, t = _ce_inputs()
    t = t.clamp_min(0)                             # no ignored row; row 0 is class 0
    run_ce(rank, x, t.to(torch.int32), None, SIZES[world], ignore_index=2 ** 40, reduction="none")
    xs = x[..., _slice(rank, SIZES[world])]
    wide = fd.vocab_parallel_cross_entropy(xs, t.to(torch.int32), ignore_index=2 ** 40, return_stats=True)
    assert bool((wide.predicted_tokens >= 0).all()), "a row was treated as ignored"
    h, W, _, _ = _linear_inputs()
    ws = W[_slice(rank, SIZES[world])]
    a = lce(h, ws, t.to(torch.int32), ignore_index=2 ** 40, reduction="none")
    assert torch.equal(a, lce(h, ws, t, ignore_index=2 ** 40, reduction="none"))


@check
def autocast_bf16(rank, world):
    """Under CPU bf16 autocast: the linear op with fp32 leaves is EXACTLY the op on the
    bf16-cast inputs without autocast (loss bit for bit, gradients those bf16 gradients upcast to the
    fp32 leaves), as stock ``F.linear`` under autocast; the cross-entropy op (fp32 logits, class weights
    and smoothing: the smoothing matmul must not be downcast) is exactly the op without autocast."""
    cols = _slice(rank, SIZES[world])
    h, W, b, t = _linear_inputs()
    x, _ = _ce_inputs()
    cw = make_weight(V)
    for reduction in REDUCTIONS:
        up = _upstream(reduction)
        results = []
        for amp in (True, False):
            dtype = torch.float32 if amp else torch.bfloat16   # no autocast: hand it the cast tensors
            leaves = [h.to(dtype).requires_grad_(), W[cols].to(dtype).requires_grad_(),
                      b[cols].to(dtype).requires_grad_()]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = fd.vocab_parallel_linear_cross_entropy(leaves[0], leaves[1], t, leaves[2],
                                                              label_smoothing=0.1, reduction=reduction)
            grads = torch.autograd.grad(loss, leaves, _upstream_for(loss, up))
            assert all(g.dtype == dtype for g in grads)
            results.append([loss, *(g.float() for g in grads)])
        for name, a, e in zip(("loss", "grad_hidden", "grad_weight", "grad_bias"), *results):
            assert torch.equal(a, e), f"linear {reduction} {name}: autocast differs from the cast inputs"
        results = []
        for amp in (True, False):
            xs = x[..., cols].clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = fd.vocab_parallel_cross_entropy(xs, t, cw[cols], label_smoothing=0.1,
                                                       reduction=reduction)
            (grad,) = torch.autograd.grad(loss, xs, _upstream_for(loss, up))
            assert loss.dtype == grad.dtype == torch.float32
            results.append((loss, grad))
        for name, a, e in zip(("loss", "grad"), *results):
            assert torch.equal(a, e), f"cross_entropy {reduction} {name}: autocast changed the fp32 op"


MASKED_SIZES = {2: (4, 4), 3: (4, 2, 2)}   # C13: V = 8, the last 4 classes masked in row 0


def _masked_inputs():
    """(6, 8) logits with -inf on: row 0 C13's last four classes (the other ranks' whole slices), row 1
    the first four (rank 0's whole slice), row 2 every other class; rows 3-4 plain, row 5 ignored."""
    x = torch.randn(6, 8) * 2
    x[0] = torch.tensor([1.0, 2.0, 3.0, 4.0, -INF, -INF, -INF, -INF])
    x[1, :4] = -INF
    x[2, ::2] = -INF
    return x, torch.tensor([2, 5, 3, 0, 7, -100])


@check
def masked_shards(rank, world):
    """C13 (docs/cases.md) and its kind: a slice whose logits are all -inf in a row contributes exactly 0 to
    the merged (max, sum-exp); with softcap, class weights and z-loss; and a -inf bias shard in the
    linear form. Compared with the float64 oracle and the single-process op by ``run_ce``."""
    x, t = _masked_inputs()
    sizes = MASKED_SIZES[world]
    loss, _, _ = run_ce(rank, x, t, None, sizes, upstream=torch.randn(6), reduction="none")
    assert abs(float(loss[0]) - 1.4401897) <= 1e-6, f"C13: {float(loss[0])} on rank {rank}"
    for kw in ({"softcap": 30.0}, {"lse_square_scale": 1e-3}, {"return_stats": True}):
        run_ce(rank, x, t, None, sizes, reduction="mean", **kw)
    run_ce(rank, x, t, make_weight(8), sizes, reduction="sum", lse_square_scale=1e-3)
    # an ignored row that is -inf everywhere: loss 0, gradient exactly 0, nothing NaN
    cols = _slice(rank, sizes)
    xs = x.clone()
    xs[5] = -INF
    xs = xs[:, cols].clone().requires_grad_()
    out = fd.vocab_parallel_cross_entropy(xs, t, lse_square_scale=1e-3, return_stats=True)
    out.loss.backward()
    assert bool(torch.isfinite(out.loss)) and bool(torch.isfinite(xs.grad).all()) and bool((xs.grad[5] == 0).all())
    # the linear form: classes 4..7 masked by a -inf bias (targets avoid them)
    h, W = torch.randn(6, H), torch.randn(8, H) * 0.3
    b = torch.randn(8)
    b[4:] = -INF
    tl = torch.tensor([0, 1, 2, 3, -100, 1])
    for reduction in ("mean", "none"):
        run_linear(rank, h, W, tl, b, None, sizes, upstream=torch.randn(6) if reduction == "none" else None,
                   reduction=reduction, lse_square_scale=1e-3)


@check
def precision_and_exact_zeros(rank, world):
    """Gradient precision (C14) on the vocab-parallel path (it shares core/row_math.py's gradient): fp32 logits x1e3 and
    x1e4, whole gradient (gathered from the ranks) within 2x the Frobenius error of stock fp32
    F.cross_entropy vs float64 (see test_gradient_precision.py); V = 1 on one rank (the others hold
    empty slices): loss and gradient exactly 0."""
    cols = _slice(rank, SIZES[world])
    for scale in (1e3, 1e4):
        x = make_logits((*SHAPE, V), torch.float32, scale, requires_grad=False)
        t = _target()
        xs = x[..., cols].clone().requires_grad_()
        fd.vocab_parallel_cross_entropy(xs, t).backward()
        parts = [None] * world
        dist.all_gather_object(parts, xs.grad)
        ours = torch.cat(parts, dim=-1).double()
        stock, exact = x.clone().requires_grad_(), x.double().requires_grad_()
        F.cross_entropy(stock.reshape(-1, V), t.reshape(-1)).backward()
        F.cross_entropy(exact.reshape(-1, V), t.reshape(-1)).backward()
        err, stock_err = float((ours - exact.grad).norm()), float((stock.grad.double() - exact.grad).norm())
        assert err <= 2.0 * stock_err, f"x{scale:g}: |grad - fp64| {err:.3e}, stock fp32 {stock_err:.3e}"
    one = (torch.randn(5, 1) * 30) if rank == 0 else torch.empty(5, 0)
    one.requires_grad_()
    t1 = torch.tensor([0, 0, -100, 0, 0])
    loss = fd.vocab_parallel_cross_entropy(one, t1, label_smoothing=0.1, reduction="sum")
    loss.backward()
    assert float(loss) == 0.0 and bool((one.grad == 0).all()), (float(loss), one.grad)


@check
def logit_scale_and_token_scaling(rank, world):
    """The contract's ``logit_scale`` and ``use_token_scaling`` on both vocab-parallel ops,
    with class weights, smoothing and z-loss, against the float64 oracle and the single-process op."""
    x, t = _ce_inputs()
    h, W, b, _ = _linear_inputs()
    cw = make_weight(V)
    for kw in ({"logit_scale": 0.5, "softcap": 4.0}, {"use_token_scaling": True, "logit_scale": 2.0},
               {"use_token_scaling": True, "label_smoothing": 0.1, "lse_square_scale": 1e-3}):
        for reduction in ("mean", "none"):
            run_ce(rank, x, t, cw, SIZES[world], upstream=_upstream(reduction), reduction=reduction, **kw)
            run_linear(rank, h, W, t, b, cw, SIZES[world], upstream=_upstream(reduction), reduction=reduction,
                       **kw)


@check
def backward_twice(rank, world):
    """A second backward through a retained graph (docs/cases.md C16) on both vocab-parallel ops: twice
    the gradients of one backward (the backward recomputes; the linear one all-reduces each time);
    create_graph raises."""
    cols = _slice(rank, SIZES[world])
    x, t = _ce_inputs()
    h, W, b, _ = _linear_inputs()
    for reduction in REDUCTIONS:
        up = _upstream_for(torch.zeros(SHAPE) if reduction == "none" else torch.zeros(()), _upstream(reduction))
        xs = x[..., cols].clone().requires_grad_()
        loss = fd.vocab_parallel_cross_entropy(xs, t, reduction=reduction, lse_square_scale=1e-3)
        (once,) = torch.autograd.grad(loss, xs, up, retain_graph=True)
        loss.backward(up, retain_graph=True)
        loss.backward(up)
        assert torch.allclose(xs.grad, 2 * once, rtol=1e-6, atol=1e-7), "vocab_parallel_cross_entropy"
        leaves = [h.clone().requires_grad_(), W[cols].clone().requires_grad_()]
        loss = fd.vocab_parallel_linear_cross_entropy(*leaves, t, reduction=reduction)
        once = torch.autograd.grad(loss, leaves, up, retain_graph=True)
        loss.backward(up)
        for leaf, g in zip(leaves, once):
            assert torch.allclose(leaf.grad, g, rtol=1e-5, atol=1e-6), "vocab_parallel_linear_cross_entropy"
    xs = x[..., cols].clone().requires_grad_()
    try:
        torch.autograd.grad(fd.vocab_parallel_cross_entropy(xs, t), xs, create_graph=True)
    except RuntimeError as e:
        assert "create_graph" in str(e)
    else:
        raise AssertionError("create_graph=True must raise")


@pytest.mark.parametrize("name", list(CHECKS))
@over_worlds
def test_vocab_parallel(world, backend, name, request, tmp_path_factory):
    """Every check on 2 and 3 gloo ranks (``dist_harness.WORLD_BACKENDS``: the Triton kernels on 2)."""
    outcome = results(__name__, CHECKS, world, backend, request, tmp_path_factory)[name]
    assert_passed(outcome, world)


def test_argmax_key_orders_like_floats_then_lowest_index():
    """The packed (max, argmax) key: float order, signed zeros equal, lower index wins a tie."""
    values = torch.tensor([1.0, -1.0, -2.0, 0.0, -0.0, float("inf"), float("-inf"), 3e38, -1e-45, 1e-45,
                           2.0, 2.0])
    index = torch.tensor([7, 3, 0, 9, 1, 5, 2, 4, 8, 6, 11, 10]) + 2 ** 31
    key = pack_max_key(values, index)
    back, idx = unpack_max_key(key)
    assert torch.equal(idx, index) and torch.equal(back, torch.where(values == 0, 0.0, values))
    x = torch.randn(4096) * torch.logspace(-30, 30, 4096)
    ordered = x[torch.argsort(pack_max_key(x, torch.zeros(4096, dtype=torch.long)), stable=True)]
    assert torch.equal(ordered, torch.sort(x).values)
    assert int(key[10]) < int(key[11])   # 2.0 at index 11 loses to 2.0 at index 10
    assert int(key[3]) < int(key[4]) == int(pack_max_key(values[3:4], index[4:5]))   # -0.0 is +0.0


def test_needs_an_initialized_process_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("this pytest process already has a process group")
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.vocab_parallel_cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]))
