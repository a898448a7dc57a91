"""Vocab-parallel cross-entropy with probability ("soft") targets (issue 30): each rank holds its slice of the
target ``(..., V_r)`` next to its logits columns / LM-head rows; values and gradients against the float64
oracle (``reference64_soft``) on the concatenated vocabulary, on 2 and 3 gloo ranks, both backends.

How it runs: as ``test_distributed.py`` (``dist_harness``: one spawn per world size and backend, every rank
runs every check with the same seeded inputs and raises on failure).

Shapes: V = 17 split unevenly, 7 + 10 over 2 ranks and 5 + 1 + 11 over 3 (a one-class slice); the
``empty_slice`` check puts 0 classes on rank 0 (0 + 17, 0 + 7 + 10). (3, 5) = 15 tokens, H = 12; targets
softmax(randn * 2) rows, one one-hot row on the last global class, one row with zeros (not renormalized).
The linear op runs with chunk_size None (one chunk) and 4 (a partial last chunk). Bounds: the contract's
tolerance table (``tolerances.py``) applied to the oracle as in ``tests/linear/test_linear_soft_targets.py``
(the hidden / weight / bias gradients from the oracle's logits gradient by the chain rule in float64).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusedce
import fusedce.distributed as fd
from dist_harness import assert_passed, over_worlds, results
from reference64_soft import reference_soft
from tolerances import FP32_UNITS, LINEAR_MAX_RTOL, TOLERANCES, U32, _check, assert_loss_close

V, SHAPE, H = 17, (3, 5), 12
SIZES = {2: (7, 10), 3: (5, 1, 11)}
EMPTY_FIRST = {2: (0, 17), 3: (0, 7, 10)}
REDUCTIONS = ("mean", "sum", "none")
TOL = TOLERANCES[torch.float32]
CHECKS = {}

OPTIONS = {
    "plain": {},
    "smoothing+weight": {"label_smoothing": 0.1, "weight": True},
    "zloss+softcap+scale": {"lse_square_scale": 1e-2, "softcap": 5.0, "logit_scale": 1.5},
    "token_weights+num_items": {"token_weights": True, "lse_square_scale": 1e-2, "num_items_in_batch": 11},
    "everything": {"weight": True, "label_smoothing": 0.3, "lse_square_scale": 1e-2, "softcap": 8.0,
                   "logit_scale": 0.7, "token_weights": True},
}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _slice(rank, sizes):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _target(dtype=torch.float32):
    q = torch.softmax(torch.randn(*SHAPE, V) * 2.0, dim=-1)
    flat = q.view(-1, V)
    flat[0] = F.one_hot(torch.tensor(V - 1), V).float()
    flat[1, ::3] = 0.0
    return q.to(dtype)


def _options(spec):
    """(op keywords, oracle keywords, class weights or None) of an OPTIONS entry."""
    kw = {k: v for k, v in spec.items() if k not in ("weight", "token_weights")}
    weight = torch.rand(V) + 0.5 if spec.get("weight") else None
    if spec.get("token_weights"):
        kw["token_weights"] = torch.rand(SHAPE) * 2.0
    return kw, weight


def _upstream(reduction):
    return torch.randn(SHAPE) if reduction == "none" else torch.tensor(3.7)


def _grad_bound(ref):
    g = ref.grad
    return (TOL.grad_rtol * g.abs() + FP32_UNITS * U32 * ref.grad_err_scale + TOL.grad_atol).nan_to_num(0.0)


def _logits_case(rank, sizes, spec, reduction, q_dtype=torch.float32):
    sl = _slice(rank, sizes)
    logits, q = torch.randn(*SHAPE, V) * 3.0, _target(q_dtype)
    kw, weight = _options(spec)
    up = _upstream(reduction)
    ref = reference_soft(logits, q, weight, reduction=reduction, upstream=up, **kw)
    mine = logits[..., sl].clone().requires_grad_()
    q_mine = q[..., sl].clone()
    before = (mine.detach().clone(), q_mine.clone())
    loss = fd.vocab_parallel_cross_entropy(mine, q_mine, None if weight is None else weight[sl],
                                           reduction=reduction, **kw)
    (grad,) = torch.autograd.grad(loss, mine, up.expand_as(loss))
    assert_loss_close(loss.detach(), ref, torch.float32)
    assert grad.dtype == torch.float32 and grad.shape == mine.shape
    _check("grad", grad, ref.grad[..., sl], _grad_bound(ref)[..., sl])
    assert torch.equal(mine.detach(), before[0]) and torch.equal(q_mine, before[1]), "an input was modified"


def _linear_case(rank, sizes, spec, reduction, chunk_size):
    sl = _slice(rank, sizes)
    hidden, weight = torch.randn(*SHAPE, H), torch.randn(V, H) * (2.0 / H ** 0.5)
    bias, q = torch.randn(V) * 0.5, _target()
    kw, cw = _options(spec)
    up = _upstream(reduction)
    ref = reference_soft(F.linear(hidden, weight, bias), q, cw, reduction=reduction, upstream=up, **kw)
    leaves = [hidden.clone().requires_grad_(), weight[sl].clone().requires_grad_(), bias[sl].clone().requires_grad_()]
    loss = fd.vocab_parallel_linear_cross_entropy(leaves[0], leaves[1], q[..., sl].clone(), leaves[2],
                                                  ce_weight_shard=None if cw is None else cw[sl],
                                                  reduction=reduction, chunk_size=chunk_size, **kw)
    grads = torch.autograd.grad(loss, leaves, up.expand_as(loss))
    assert_loss_close(loss.detach(), ref, torch.float32)
    g, gb = ref.grad.reshape(-1, V), _grad_bound(ref).reshape(-1, V)
    h64, w64 = hidden.double().reshape(-1, H), weight.double()
    expected = {"hidden": (g @ w64, gb @ w64.abs() + FP32_UNITS * U32 * (g.abs() @ w64.abs())),
                "weight": ((g.t() @ h64)[sl], (gb.t() @ h64.abs() + FP32_UNITS * U32 * (g.abs().t() @ h64.abs()))[sl]),
                "bias": (g.sum(0)[sl], (gb.sum(0) + FP32_UNITS * U32 * g.abs().sum(0))[sl])}
    for name, grad in zip(("hidden", "weight", "bias"), grads):
        value, bound = expected[name]
        _check(f"grad_{name}", grad.reshape(value.shape), value, bound)


@check
def soft_logits_options(rank, world):
    """The logits op: every option set x every reduction ("none" with a per-token upstream gradient)."""
    for spec in OPTIONS.values():
        for reduction in REDUCTIONS:
            _logits_case(rank, SIZES[world], spec, reduction)


@check
def soft_linear_options(rank, world):
    """The linear op: every option set x every reduction, one chunk and chunks of 4 tokens."""
    for spec in OPTIONS.values():
        for reduction in REDUCTIONS:
            for chunk_size in (None, 4):
                _linear_case(rank, SIZES[world], spec, reduction, chunk_size)


@check
def soft_empty_slice_and_low_precision_target(rank, world):
    """A rank holding 0 classes (its slices (..., 0)), one holding 1, and bf16 / fp64 targets."""
    _logits_case(rank, EMPTY_FIRST[world], OPTIONS["everything"], "mean")
    _linear_case(rank, EMPTY_FIRST[world], OPTIONS["everything"], "none", 4)
    one = {2: (16, 1), 3: (5, 1, 11)}[world]   # a one-class slice (the Triton kernels run on 2 ranks only)
    _logits_case(rank, one, OPTIONS["everything"], "mean")
    _linear_case(rank, one, OPTIONS["everything"], "none", 4)
    for q_dtype in (torch.bfloat16, torch.float64):
        _logits_case(rank, SIZES[world], OPTIONS["smoothing+weight"], "sum", q_dtype)


@check
def soft_stats(rank, world):
    """return_stats: the global lse, the global argmax of the logits (predicted_tokens) and token_accuracy
    against the global argmax of the target, equal on every rank to the oracle's."""
    sl = _slice(rank, SIZES[world])
    logits, q = torch.randn(*SHAPE, V) * 3.0, _target()
    logits.view(-1, V)[3, 1:] = logits.view(-1, V)[3, 0] - 1.0   # row 3: argmax 0 (rank 0's)
    for reduction in REDUCTIONS:
        ref = reference_soft(logits, q, reduction=reduction, lse_square_scale=1e-2)
        out = fd.vocab_parallel_cross_entropy(logits[..., sl], q[..., sl], reduction=reduction,
                                              lse_square_scale=1e-2, return_stats=True)
        assert torch.equal(out.predicted_tokens, ref.predicted.reshape(SHAPE))
        assert torch.equal(out.token_accuracy.double(), ref.token_accuracy), (out.token_accuracy, ref.token_accuracy)
        lse_bound = FP32_UNITS * U32 * ref.row_mag
        _check("lse", out.lse, ref.lse, lse_bound)
        assert_loss_close(out.loss.detach(), ref, torch.float32)


def _raises(fn, *words):
    try:
        fn()
    except ValueError as error:
        for word in words:
            assert word in str(error), f"{word!r} not in: {error}"
        return
    raise AssertionError(f"no ValueError for {words}")


@check
def soft_bad_values(rank, world):
    """A negative, NaN or +inf probability on ONE rank's slice: ValueError naming ``target`` on EVERY rank (no
    rank left waiting in a collective), before any gradient is written; a wrong width names the shape."""
    sizes = SIZES[world]
    sl = _slice(rank, sizes)
    logits, q = torch.randn(*SHAPE, V), _target()
    hidden, weight = torch.randn(*SHAPE, H), torch.randn(V, H)
    for bad_rank, value in ((world - 1, -0.25), (0, float("nan")), (world - 1, float("inf"))):
        mine = q[..., sl].clone()
        if rank == bad_rank:
            mine.view(-1, sizes[rank])[4, 0] = value
        x = logits[..., sl].clone().requires_grad_()
        _raises(lambda: fd.vocab_parallel_cross_entropy(x, mine), "target", f"rank(s) [{bad_rank}]"
                if rank != bad_rank else "target[0, 4, 0]")
        w = weight[sl].clone().requires_grad_()
        _raises(lambda: fd.vocab_parallel_linear_cross_entropy(hidden, w, mine), "target")
        assert x.grad is None and w.grad is None
    _raises(lambda: fd.vocab_parallel_cross_entropy(logits[..., sl], q), "shape")   # the full target


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world,))


@check
def soft_dtensor_head(rank, world):
    """``fusedce.linear_cross_entropy`` / ``cross_entropy`` with a Shard(0) head / Shard(-1) logits and a
    probability target given as a Shard(-1) DTensor, a replicated DTensor or the plain full tensor: the
    replicated loss and the gradients in the inputs' placements equal the single-process op's (the two
    sum the same fp32 terms in another order: 2e-5 absolute, 2^-16 of the largest gradient). The defaults
    ``batch_invariant=False`` / ``logits_dtype="float32"`` pass; other values are refused by name."""
    from torch.distributed import tensor as dt
    mesh = _mesh(world)
    hidden, weight, q = torch.randn(*SHAPE, H), torch.randn(V, H) * 0.5, _target()
    full_w = weight.clone().requires_grad_()
    expected = fusedce.linear_cross_entropy(hidden, full_w, q, label_smoothing=0.1)
    expected.backward()
    for target in (dt.distribute_tensor(q, mesh, [dt.Shard(2)]), dt.distribute_tensor(q, mesh, [dt.Replicate()]), q):
        w = dt.distribute_tensor(weight, mesh, [dt.Shard(0)]).requires_grad_()
        loss = fusedce.linear_cross_entropy(hidden, w, target, label_smoothing=0.1, batch_invariant=False,
                                            logits_dtype="float32")
        loss.backward()
        assert isinstance(loss, dt.DTensor) and loss.placements[0].is_replicate()
        assert float((loss.to_local() - expected).abs()) <= 2e-5
        grad = w.grad.full_tensor()
        assert float((grad - full_w.grad).abs().max()) <= 2.0 ** -16 * max(float(full_w.grad.abs().max()), 1.0)
    logits = torch.randn(*SHAPE, V)
    full_x = logits.clone().requires_grad_()
    expected = fusedce.cross_entropy(full_x, q, reduction="sum")
    expected.backward()
    x = dt.distribute_tensor(logits, mesh, [dt.Shard(2)]).requires_grad_()
    loss = fusedce.cross_entropy(x, dt.distribute_tensor(q, mesh, [dt.Shard(2)]), reduction="sum")
    loss.backward()
    assert float((loss.to_local() - expected).abs()) <= 2e-5 * max(1.0, float(expected.abs()))
    grad_err = float((x.grad.full_tensor() - full_x.grad).abs().max())
    assert grad_err <= LINEAR_MAX_RTOL * max(float(full_x.grad.abs().max()), 1.0)
    w = dt.distribute_tensor(weight, mesh, [dt.Shard(0)])
    _raises(lambda: fusedce.linear_cross_entropy(hidden, w, q, batch_invariant=True), "batch_invariant=True")
    _raises(lambda: fusedce.linear_cross_entropy(hidden, w, q, logits_dtype="input"), "logits_dtype='input'")
    target = torch.randint(0, V, SHAPE)   # class indices: the same keywords, the same answers
    assert torch.isfinite(fusedce.linear_cross_entropy(hidden, w, target, batch_invariant=False).to_local())
    _raises(lambda: fusedce.linear_cross_entropy(hidden, w, target, batch_invariant=True), "batch_invariant")


@pytest.mark.parametrize("name", list(CHECKS))
@over_worlds
def test_vocab_parallel_soft(world, backend, name, request, tmp_path_factory):
    """Every check on 2 and 3 gloo ranks (``dist_harness.WORLD_BACKENDS``: the Triton kernels on 2)."""
    outcome = results(__name__, CHECKS, world, backend, request, tmp_path_factory)[name]
    assert_passed(outcome, world)
