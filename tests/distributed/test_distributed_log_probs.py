"""Vocab-parallel RL ops (``fusedce.distributed.vocab_parallel_token_log_probs`` /
``vocab_parallel_linear_token_log_probs``) against a float64 reference written from the contract's
formulas on the concatenated vocabulary, on CPU/gloo at 2 and 3 ranks, each backend (Triton under the
interpreter). Spawning costs: every check runs in one spawned group per (world, backend)
(``dist_harness.py``), and each pytest test reads one check's outcome.

Shapes: V = 11 classes split unevenly, 5 + 6 over 2 ranks and 3 + 4 + 4 over 3; (3, 4) = 12 tokens (2
leading dims), every 4th row ignored (3 ignored, 9 kept), target 0 in row 0 and V - 1 (the last rank's
last column) in row 1; H = 8 for the linear op, chunk_size None (one chunk) and 4 (9 kept rows: a
partial last chunk). Settings: temperature 1 and 2, softcap 3 (strong capping of logits ~ N(0, 3^2)).

The checks of ``tests/support/sampled_checks.py`` (``return_stats``, ``logits_dtype="input"``, ``top_k`` /
``top_p`` of the linear op; issue 45) run in the same spawned groups.

Reference: the RL ops' one (``tests/support/reference64_log_probs.py``): ``z = c tanh(x / c)``,
``q = z / T``, ``log_probs = q_t - logsumexp(q)``, ``entropy = logsumexp(q) - sum_c softmax(q)_c q_c`` (a
-inf ``q_c`` adds 0), in float64 autograd; the upstream gradients of both outputs are random per token.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fusedce
import fusedce.distributed as fd
from dist_harness import assert_passed, over_worlds, results
from inputs import make_target
from reference64_log_probs import reference_log_probs
from sampled_checks import CHECKS as SAMPLED_CHECKS
from tolerances import FP32_MATH_ATOL, LINEAR_MAX_RTOL, VP_GRAD_MAX_RTOL, VP_GRAD_RTOL

V, SHAPE, H = 11, (3, 4), 8
SIZES = {2: (5, 6), 3: (3, 4, 4)}
SETTINGS = ((1.0, None), (2.0, None), (2.0, 3.0))   # (temperature, softcap)
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


# ---------------------------------------------------------------------------------------- helpers
def _cols(rank, sizes):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _within(name, actual, expected, bound):
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert not bool(a.isnan().any()), f"{name}: NaN"
    diff = (a - e).abs()
    bad = diff > bound
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} elements off, max |diff| {float(diff.max()):.3e}"


def _grad_bound(ref, dtype, max_rtol=VP_GRAD_MAX_RTOL):
    return VP_GRAD_RTOL[dtype] * ref.abs() + max_rtol * ref.abs().max().clamp_min(1e-30)


def _objective(out, up_lp, up_ent):
    """``sum up_lp * log_probs (+ sum up_ent * entropy)`` for a Tensor or a TokenLogProbs."""
    if isinstance(out, fusedce.TokenLogProbs):
        total = (up_lp * out.log_probs).sum() if up_lp is not None else 0.0
        return total + (up_ent * out.entropy).sum()
    return (up_lp * out).sum()


def _check_outputs(out, ref_lp, ref_ent, return_entropy, target):
    if return_entropy:
        assert isinstance(out, fusedce.TokenLogProbs), type(out)
        log_probs, entropy = out
        assert entropy.dtype == torch.float32 and entropy.shape == target.shape
        _within("entropy", entropy, ref_ent, FP32_MATH_ATOL)
        assert bool((entropy[target == -100] == 0).all()), "entropy of ignored rows"
    else:
        assert isinstance(out, torch.Tensor) and not isinstance(out, tuple), type(out)
        log_probs = out
    assert log_probs.dtype == torch.float32 and log_probs.shape == target.shape
    _within("log_probs", log_probs, ref_lp, FP32_MATH_ATOL)
    assert bool((log_probs[target == -100] == 0).all()), "log_probs of ignored rows"


def _run_logits(rank, sizes, x, t, temperature, softcap, return_entropy, up_lp, up_ent, starts=None):
    """The logits form on this rank's slice vs the float64 reference and the single-process op."""
    cols = slice(starts[rank], starts[rank] + sizes[rank]) if starts else _cols(rank, sizes)
    xs = x.detach()[..., cols].clone().requires_grad_()
    out = fd.vocab_parallel_token_log_probs(xs, t, temperature=temperature, softcap=softcap,
                                            return_entropy=return_entropy,
                                            vocab_start_index=starts[rank] if starts else None)
    x64 = x.detach().double().requires_grad_()
    ref_lp, ref_ent = reference_log_probs(x64, t, temperature, softcap)
    _check_outputs(out, ref_lp, ref_ent, return_entropy, t)
    _objective(out, up_lp, up_ent).backward()
    _objective(fusedce.TokenLogProbs(ref_lp, ref_ent) if return_entropy else ref_lp,
               None if up_lp is None else up_lp.double(), None if up_ent is None else up_ent.double()).backward()
    g_ref = x64.grad[..., cols]
    assert xs.grad.dtype == x.dtype and xs.grad.shape == xs.shape
    _within("grad", xs.grad, g_ref, _grad_bound(g_ref, x.dtype))
    assert bool((xs.grad[t == -100] == 0).all()), "grad of ignored rows"
    # the single-process op on the full logits: the same type, dtypes and (within the bound) values
    single = fusedce.token_log_probs(x.detach(), t, temperature=temperature, softcap=softcap,
                                     return_entropy=return_entropy, backend="torch")
    assert type(single) is type(out)
    for a, b in zip(out if return_entropy else (out,), single if return_entropy else (single,)):
        _within("vs single-process", a, b, 2 * FP32_MATH_ATOL)
    return xs.grad


def _linear_inputs(bias=True):
    h = torch.randn(*SHAPE, H)
    W = torch.randn(V, H) * 0.7
    b = torch.randn(V) if bias else None
    return h, W, b


def _run_linear(rank, sizes, h, W, b, t, temperature, softcap, return_entropy, up_lp, up_ent, **kw):
    """The linear form with this rank's head rows vs float64 ``F.linear`` + the reference."""
    cols = _cols(rank, sizes)
    leaves = [h.clone().requires_grad_(), W[cols].clone().requires_grad_()]
    if b is not None:
        leaves.append(b[cols].clone().requires_grad_())
    out = fd.vocab_parallel_linear_token_log_probs(leaves[0], leaves[1], t, leaves[2] if b is not None else None,
                                                   temperature=temperature, softcap=softcap,
                                                   return_entropy=return_entropy, **kw)
    full = [h.double().requires_grad_(), W.double().requires_grad_()]
    if b is not None:
        full.append(b.double().requires_grad_())
    logits64 = torch.nn.functional.linear(*full)
    ref_lp, ref_ent = reference_log_probs(logits64, t, temperature, softcap)
    rel = LINEAR_MAX_RTOL * max(float(ref_lp.abs().max()), float(ref_ent.abs().max()), 1.0)
    if return_entropy:
        assert isinstance(out, fusedce.TokenLogProbs)
        _within("entropy", out.entropy, ref_ent, rel)
        log_probs = out.log_probs
    else:
        log_probs = out
    assert log_probs.dtype == torch.float32 and log_probs.shape == t.shape
    _within("log_probs", log_probs, ref_lp, rel)
    _objective(out, up_lp, up_ent).backward()
    _objective(fusedce.TokenLogProbs(ref_lp, ref_ent) if return_entropy else ref_lp,
               None if up_lp is None else up_lp.double(), None if up_ent is None else up_ent.double()).backward()
    refs = [full[0].grad, full[1].grad[cols]] + ([full[2].grad[cols]] if b is not None else [])
    for name, leaf, ref in zip(("hidden", "weight_shard", "bias_shard"), leaves, refs):
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape, name
        _within(f"grad {name}", leaf.grad, ref, _grad_bound(ref, torch.float32, LINEAR_MAX_RTOL))
    return out, leaves


def _raises(exc, match, fn):
    try:
        fn()
    except exc as e:
        assert match in str(e), f"{exc.__name__} without {match!r}: {e}"
    else:
        raise AssertionError(f"expected {exc.__name__} ({match!r})")


# ---------------------------------------------------------------------------------------- checks
@check
def logits_form(rank, world):
    """Temperature, softcap, entropy both ways, fp32 and bf16, int32 target, random upstreams of both
    outputs (and of the entropy alone)."""
    sizes = SIZES[world]
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(*SHAPE, V) * 3).to(dtype)
        t = make_target(SHAPE, V, ignore_every=4)
        for temperature, softcap in SETTINGS:
            for return_entropy in (False, True):
                up_lp, up_ent = torch.randn(SHAPE), torch.randn(SHAPE)
                _run_logits(rank, sizes, x, t, temperature, softcap, return_entropy, up_lp,
                            up_ent if return_entropy else None)
        # the entropy's gradient alone; an int32 target
        _run_logits(rank, sizes, x, t.int(), 2.0, 3.0, True, None, torch.randn(SHAPE))


@check
def explicit_vocab_start_index(rank, world):
    """Slices held in reverse rank order, given by ``vocab_start_index`` on every rank."""
    sizes = SIZES[world]
    held = [world - 1 - r for r in range(world)]           # rank r holds the (world-1-r)-th slice
    starts = [sum(sizes[:j]) for j in held]
    per_rank = [sizes[j] for j in held]
    x, t = torch.randn(*SHAPE, V) * 3, make_target(SHAPE, V, ignore_every=4)
    _run_logits(rank, per_rank, x, t, 2.0, 3.0, True, torch.randn(SHAPE), torch.randn(SHAPE), starts=starts)


@check
def masked_shard(rank, world):
    """One rank's whole slice -inf in every row (a masked / padded part of the vocabulary) and a few
    -inf logits elsewhere: that slice adds exactly 0 and gets an exactly zero gradient."""
    sizes = SIZES[world]
    masked = _cols(world - 2, sizes)             # rank world-2's slice: the middle / first one
    x = torch.randn(*SHAPE, V) * 3
    x[..., masked] = float("-inf")
    x[0, 1, V - 2] = x[2, 0, 0] = float("-inf")
    allowed = torch.tensor([c for c in range(V) if not (masked.start <= c < masked.stop) and c not in (0, V - 2)])
    t = allowed[torch.randint(0, len(allowed), SHAPE)]
    t[1, 1] = -100
    for temperature, softcap in ((1.0, None), (2.0, None), (2.0, 3.0)):
        grad = _run_logits(rank, sizes, x, t, temperature, softcap, True, torch.randn(SHAPE), torch.randn(SHAPE))
        if rank == world - 2:
            assert bool((grad == 0).all()), "gradient of a wholly -inf slice"


@check
def all_ignored_and_empty(rank, world):
    """All rows ignored: 0 in both outputs, exactly zero gradients (both forms); an empty batch."""
    sizes, cols = SIZES[world], _cols(rank, SIZES[world])
    t = torch.full(SHAPE, -100)
    xs = (torch.randn(*SHAPE, V) * 3)[..., cols].requires_grad_()
    out = fd.vocab_parallel_token_log_probs(xs, t, temperature=2.0, softcap=3.0, return_entropy=True)
    assert bool((out.log_probs == 0).all()) and bool((out.entropy == 0).all())
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert bool((xs.grad == 0).all())
    h, W, b = _linear_inputs()
    leaves = [h.requires_grad_(), W[cols].clone().requires_grad_(), b[cols].clone().requires_grad_()]
    out = fd.vocab_parallel_linear_token_log_probs(*leaves[:2], t, leaves[2], return_entropy=True)
    assert bool((out.log_probs == 0).all()) and bool((out.entropy == 0).all())
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert all(bool((leaf.grad == 0).all()) for leaf in leaves)
    empty = torch.randn(0, sizes[rank]).requires_grad_()
    out = fd.vocab_parallel_token_log_probs(empty, torch.zeros(0, dtype=torch.long), return_entropy=True)
    assert out.log_probs.shape == out.entropy.shape == (0,)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert empty.grad.shape == empty.shape


@check
def linear_form(rank, world):
    """Bias or not, chunk_size None and 4 (a partial last chunk), temperature / softcap, entropy both
    ways, random upstreams of both outputs."""
    sizes = SIZES[world]
    t = make_target(SHAPE, V, ignore_every=4)
    for bias, chunk_size, (temperature, softcap), return_entropy in (
            (True, None, (1.0, None), True), (True, 4, (2.0, 3.0), True), (False, 4, (2.0, None), False),
            (False, None, (1.0, 3.0), True)):
        h, W, b = _linear_inputs(bias)
        _run_linear(rank, sizes, h, W, b, t, temperature, softcap, return_entropy, torch.randn(SHAPE),
                    torch.randn(SHAPE) if return_entropy else None, chunk_size=chunk_size)


@check
def linear_masked_bias_shard(rank, world):
    """A bias slice of -inf on one rank (its classes masked out): exact zeros for its weight and bias
    gradients, the rest as the reference."""
    sizes = SIZES[world]
    masked = _cols(0, sizes)
    h, W, b = _linear_inputs()
    b[masked] = float("-inf")
    t = torch.randint(masked.stop, V, SHAPE)
    t[0, 0] = -100
    _, leaves = _run_linear(rank, sizes, h, W, b, t, 2.0, None, True, torch.randn(SHAPE), torch.randn(SHAPE),
                            chunk_size=5)
    if rank == 0:
        assert bool((leaves[1].grad == 0).all()) and bool((leaves[2].grad == 0).all())


@check
def backward_twice(rank, world):
    """A second backward through a retained graph gives twice the gradients (both forms; the linear one
    all-reduces each time); create_graph=True raises a RuntimeError naming it."""
    cols = _cols(rank, SIZES[world])
    t = make_target(SHAPE, V, ignore_every=4)
    up_lp, up_ent = torch.randn(SHAPE), torch.randn(SHAPE)
    xs = (torch.randn(*SHAPE, V) * 3)[..., cols].requires_grad_()
    h, W, b = _linear_inputs()
    for leaves, op in (([xs], fd.vocab_parallel_token_log_probs),
                       ([h.requires_grad_(), W[cols].clone().requires_grad_(), b[cols].clone().requires_grad_()],
                        fd.vocab_parallel_linear_token_log_probs)):
        args = leaves[:2] + [t] + leaves[2:] if len(leaves) == 3 else leaves + [t]
        out = op(*args, temperature=2.0, return_entropy=True)
        objective = _objective(out, up_lp, up_ent)
        once = torch.autograd.grad(objective, leaves, retain_graph=True)
        objective.backward(retain_graph=True)
        for leaf, g in zip(leaves, once):
            assert torch.allclose(leaf.grad, g, rtol=1e-6, atol=1e-7), op.__name__
        objective.backward()
        for leaf, g in zip(leaves, once):
            assert torch.allclose(leaf.grad, 2 * g, rtol=1e-6, atol=1e-7), op.__name__
    _raises(RuntimeError, "create_graph",
            lambda: torch.autograd.grad(fd.vocab_parallel_token_log_probs(xs, t).sum(), xs, create_graph=True))


@check
def bad_inputs(rank, world):
    """Errors, raised the same way on every rank (so no rank waits in a collective)."""
    sizes, cols = SIZES[world], _cols(rank, SIZES[world])
    x, t = torch.randn(*SHAPE, V)[..., cols], make_target(SHAPE, V)
    h, W, _ = _linear_inputs(False)
    vp, lin = fd.vocab_parallel_token_log_probs, fd.vocab_parallel_linear_token_log_probs
    _raises(ValueError, "target shape", lambda: vp(x, t[:2]))
    _raises(ValueError, "target shape", lambda: lin(h, W[cols], t[:, :2]))
    _raises(TypeError, "int64 or int32", lambda: vp(x, t.float()))
    _raises(ValueError, "temperature", lambda: vp(x, t, temperature=0.0))
    _raises(ValueError, "hidden.shape[-1]", lambda: lin(h, W[cols, :5], t))
    _raises(ValueError, "bias_shard must have shape", lambda: lin(h, W[cols], t, torch.zeros(sizes[rank] + 1)))
    bad = t.clone()
    bad[1, 2] = V                                  # the global V: one past the last class
    _raises(IndexError, str(V), lambda: vp(x, bad))
    # slices that do not tile [0, V): a gap, an overlap
    gap = [sum(sizes[:r]) + (1 if r == world - 1 else 0) for r in range(world)]
    _raises(ValueError, "tile", lambda: vp(x, t, vocab_start_index=gap[rank]))
    _raises(ValueError, "tile", lambda: lin(h, W[cols], t, vocab_start_index=0))
    # vocab_start_index on some ranks only
    _raises(ValueError, "every rank", lambda: vp(x, t, vocab_start_index=0 if rank == 0 else None))
    dist.barrier()


# ------------------------------------------------------------------- K classes per token (issue 29)
def _k_target(world_sizes):
    """(3, 4, K=4) global ids: random, a duplicate pair in one token, an ignored entry, a wholly ignored
    token, a token whose K classes all sit on the last rank, one on the first rank's first class."""
    t = torch.randint(0, V, (*SHAPE, 4))
    t[0, 0, 1] = t[0, 0, 3]                      # a duplicate class: their upstreams add
    t[0, 1, 2] = -100                            # one ignored entry
    t[1, 2] = -100                               # a token with every entry ignored: 0 entropy, zero grad
    t[2, 3] = torch.tensor([V - 1, V - 2, V - 1, V - 3])   # all on the last rank's slice
    t[2, 0, 0] = 0
    return t


def _k_check(name, out, ref_lp, ref_ent, t, return_entropy, bound):
    log_probs = out.log_probs if return_entropy else out
    assert log_probs.dtype == torch.float32 and log_probs.shape == t.shape, (name, log_probs.shape)
    _within(f"{name} log_probs", log_probs, ref_lp, bound)
    assert bool((log_probs[t == -100] == 0).all()), f"{name}: log_probs of ignored entries"
    if return_entropy:
        assert out.entropy.shape == t.shape[:-1]
        _within(f"{name} entropy", out.entropy, ref_ent, bound)
        assert bool((out.entropy[(t == -100).all(-1)] == 0).all()), f"{name}: entropy of ignored tokens"


@check
def k_classes_logits(rank, world):
    """``(..., K)`` targets on logits slices: fp32 / bf16, temperature / softcap, entropy both ways,
    duplicates, ignored entries and tokens, int32, random upstreams of both outputs; values and the
    slice's gradient vs float64, and equal to the single-process K-class op."""
    sizes, cols = SIZES[world], _cols(rank, SIZES[world])
    t = _k_target(sizes)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(*SHAPE, V) * 3).to(dtype)
        for (temperature, softcap), return_entropy in zip(SETTINGS, (True, False, True)):
            for target in (t, t.int()) if dtype == torch.float32 else (t,):
                xs = x[..., cols].clone().requires_grad_()
                out = fd.vocab_parallel_token_log_probs(xs, target, temperature=temperature, softcap=softcap,
                                                        return_entropy=return_entropy)
                x64 = x.double().requires_grad_()
                ref_lp, ref_ent = reference_log_probs(x64, t, temperature, softcap)
                _k_check("logits", out, ref_lp, ref_ent, t, return_entropy, FP32_MATH_ATOL)
                up_lp, up_ent = torch.randn(t.shape), torch.randn(SHAPE)
                _objective(out, up_lp, up_ent if return_entropy else None).backward()
                _objective(fusedce.TokenLogProbs(ref_lp, ref_ent) if return_entropy else ref_lp, up_lp.double(),
                           up_ent.double() if return_entropy else None).backward()
                g_ref = x64.grad[..., cols]
                assert xs.grad.dtype == dtype and xs.grad.shape == xs.shape
                _within("k grad", xs.grad, g_ref, _grad_bound(g_ref, dtype))
                assert bool((xs.grad[(t == -100).all(-1)] == 0).all()), "grad of an all-ignored token"
                single = fusedce.token_log_probs(x, t, temperature=temperature, softcap=softcap,
                                                 return_entropy=return_entropy, backend="torch")
                for a, b in zip(out if return_entropy else (out,), single if return_entropy else (single,)):
                    _within("k vs single-process", a, b, 2 * FP32_MATH_ATOL)


@check
def k_classes_linear(rank, world):
    """``(..., K)`` targets with the head's rows split: bias or not, chunk_size None and 4 (a partial last
    chunk after the all-ignored token is compacted away), temperature / softcap, entropy both ways;
    values and the gradients of hidden, weight_shard and bias_shard vs float64."""
    sizes, cols = SIZES[world], _cols(rank, SIZES[world])
    t = _k_target(sizes)
    for bias, chunk_size, (temperature, softcap), return_entropy in (
            (True, None, (1.0, None), True), (True, 4, (2.0, 3.0), True), (False, 4, (2.0, None), False)):
        h, W, b = _linear_inputs(bias)
        leaves = [h.clone().requires_grad_(), W[cols].clone().requires_grad_()]
        if bias:
            leaves.append(b[cols].clone().requires_grad_())
        out = fd.vocab_parallel_linear_token_log_probs(leaves[0], leaves[1], t, leaves[2] if bias else None,
                                                       temperature=temperature, softcap=softcap,
                                                       return_entropy=return_entropy, chunk_size=chunk_size)
        full = [h.double().requires_grad_(), W.double().requires_grad_()] + ([b.double().requires_grad_()]
                                                                            if bias else [])
        ref_lp, ref_ent = reference_log_probs(torch.nn.functional.linear(*full), t, temperature, softcap)
        rel = LINEAR_MAX_RTOL * max(float(ref_lp.abs().max()), float(ref_ent.abs().max()), 1.0)
        _k_check("linear", out, ref_lp, ref_ent, t, return_entropy, rel)
        up_lp, up_ent = torch.randn(t.shape), torch.randn(SHAPE)
        _objective(out, up_lp, up_ent if return_entropy else None).backward()
        _objective(fusedce.TokenLogProbs(ref_lp, ref_ent) if return_entropy else ref_lp, up_lp.double(),
                   up_ent.double() if return_entropy else None).backward()
        refs = [full[0].grad, full[1].grad[cols]] + ([full[2].grad[cols]] if bias else [])
        for name, leaf, ref in zip(("hidden", "weight_shard", "bias_shard"), leaves, refs):
            assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape, name
            _within(f"k grad {name}", leaf.grad, ref, _grad_bound(ref, torch.float32, LINEAR_MAX_RTOL))


@check
def k_classes_bad_inputs(rank, world):
    """The K-class form's errors, the same on every rank: K = 0, a class outside the global [0, V), a
    float target, a wrong leading shape."""
    cols = _cols(rank, SIZES[world])
    x = torch.randn(*SHAPE, V)[..., cols]
    h, W, _ = _linear_inputs(False)
    vp, lin = fd.vocab_parallel_token_log_probs, fd.vocab_parallel_linear_token_log_probs
    _raises(ValueError, "K >= 1", lambda: vp(x, torch.zeros(*SHAPE, 0, dtype=torch.long)))
    _raises(ValueError, "K >= 1", lambda: lin(h, W[cols], torch.zeros(*SHAPE, 0, dtype=torch.long)))
    bad = torch.randint(0, V, (*SHAPE, 2))
    bad[1, 1, 1] = V
    _raises(IndexError, str(V), lambda: vp(x, bad))
    _raises(IndexError, str(V), lambda: lin(h, W[cols], bad))
    _raises(TypeError, "int64 or int32", lambda: vp(x, bad.float()))
    _raises(ValueError, "target shape", lambda: vp(x, bad[:2]))
    dist.barrier()


# the return_stats / logits_dtype="input" / top_k / top_p checks (issue 45), in these spawned groups
CHECKS.update(SAMPLED_CHECKS)


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CHECKS))
@over_worlds
def test_vocab_parallel_log_probs(world, backend, name, request, tmp_path_factory):
    """Every check on 2 and 3 gloo ranks (``dist_harness.WORLD_BACKENDS``: the Triton kernels on 2)."""
    outcome = results(__name__, CHECKS, world, backend, request, tmp_path_factory)[name]
    assert_passed(outcome, world)
