"""Vocab-parallel top-k distillation (``fusedce.distributed.vocab_parallel_topk_distillation_loss`` /
``vocab_parallel_linear_topk_distillation_loss``) against the float64 oracle of the top-k teacher
(``tests/references/reference64_topk.py``) on the concatenated vocabulary and against the single-process op,
on CPU/gloo at 2 and 3 ranks, each backend (Triton under the interpreter): loss, ``teacher_mass`` /
``student_mass``, gradients of the slice (and of hidden / weight / bias for the linear form).

Shapes: V = 11 split unevenly (5 + 6 over 2 ranks, 3 + 4 + 4 over 3; and with an empty slice: 0 + 11, 5 + 0 +
6); (3, 4) = 12 tokens, every 4th ignored by the target; K = 4 teacher classes per token drawn from the whole
vocabulary (so a token's classes sit on several ranks), the teacher's log-probs a log_softmax over all V
(its tail 1 - sum p_k > 0), with one padding entry (-inf), one ``ignore_index`` id, one duplicated id, one token
whose classes all sit on the last rank's slice and one whose K entries are all padding; H = 8.
Settings: tail off / on, return_stats, temperature 1 / 2, softcap 3, a hard label folded (T = 1) and in a
second pass (T = 2), every reduction.

Bounds (as test_distributed_log_probs.py: the distributed and float64 paths sum the same fp32 terms in
another order): loss and stats 2e-5 relative to max(1, |value|); gradients 1e-5 (logits) / 2^-16 (linear:
H-term dot products in fp32) of the largest reference gradient element.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fusedce
import fusedce.distributed as fd
from dist_harness import assert_passed, over_worlds, results
from reference64_topk import reduce64, topk_rows64

V, SHAPE, H, K = 11, (3, 4), 8, 4
SIZES = {2: (5, 6), 3: (3, 4, 4)}
EMPTY = {2: (0, 11), 3: (5, 0, 6)}
OUT_RTOL = 2e-5
GRAD_MAX_RTOL = 1e-5
LINEAR_MAX_RTOL = 2.0 ** -16
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _cols(rank, sizes):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _within(name, actual, expected, bound):
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert not bool(a.isnan().any()), f"{name}: NaN"
    diff = (a - e).abs()
    assert not bool((diff > bound).any()), f"{name}: max |diff| {float(diff.max()):.3e} > bound"


def _teacher():
    """``(ids, log_probs, target)``: the module docstring's teacher (global ids, identical on every rank)."""
    t_logits = torch.randn(*SHAPE, V) * 2
    lp_all = torch.log_softmax(t_logits, -1)
    ids = torch.stack([torch.randperm(V)[:K] for _ in range(12)]).reshape(*SHAPE, K)
    ids[0, 1] = torch.tensor([V - 1, V - 2, V - 3, V - 4])   # all on the last rank's slice
    lp = lp_all.gather(-1, ids)
    lp[0, 2, 1] = float("-inf")           # a padding entry
    ids[0, 3, 2] = -100                   # an ignore_index id
    ids[1, 1, 3] = ids[1, 1, 0]           # a duplicated id
    lp[1, 1, 3] = lp[1, 1, 0]
    lp[2, 1] = float("-inf")              # every entry padding
    target = torch.randint(0, V, SHAPE)
    target[:, 0] = -100                   # every 4th token ignored
    target[1, 2] = V - 1
    return ids, lp, target


def _expected(x64, ids, lp, target, reduction, **kw):
    rows = topk_rows64(x64, ids, lp, target, **kw)
    return reduce64(rows, target, reduction)


def _masses64(x64, ids, lp, target, temperature, softcap):
    keep = (lp != float("-inf")) & (ids != -100) & (target != -100)[..., None]
    z = x64 if softcap is None else softcap * torch.tanh(x64 / softcap)
    s = torch.softmax(z / temperature, -1).gather(-1, torch.where(keep, ids, 0))
    return (torch.where(keep, lp.double().exp(), 0.0).sum(-1), torch.where(keep, s, 0.0).sum(-1))


def _compare(name, out, single, ref, masses, stats):
    loss = out.loss if stats else out
    bound = OUT_RTOL * max(1.0, float(ref.abs().max()))
    _within(f"{name} loss vs float64", loss, ref, bound)
    _within(f"{name} loss vs single-process", loss, single.loss if stats else single, bound)
    if stats:
        assert isinstance(out, fusedce.TopkDistillationOutput), type(out)
        for label, got, exp, one in (("teacher_mass", out.teacher_mass, masses[0], single.teacher_mass),
                                     ("student_mass", out.student_mass, masses[1], single.student_mass)):
            assert got.dtype == torch.float32 and not got.requires_grad, label
            _within(label, got, exp, OUT_RTOL)
            _within(f"{label} vs single-process", got, one, OUT_RTOL)


LOGIT_CASES = (  # (tail, return_stats, temperature, softcap, hard_label_weight, reduction)
    (False, True, 1.0, None, 0.0, "mean"),
    (True, True, 2.0, 3.0, 0.5, "sum"),     # the hard label in a second pass at temperature 1
    (True, False, 1.0, None, 0.7, "none"),  # the hard label folded in as a (K+1)-th class
)


def _logits_case(rank, sizes, case, dtype=torch.float32):
    tail, stats, temperature, softcap, hlw, reduction = case
    ids, lp, target = _teacher()
    x = (torch.randn(*SHAPE, V) * 2).to(dtype)
    cols = _cols(rank, sizes)
    xs = x[..., cols].clone().requires_grad_()
    kw = dict(temperature=temperature, student_softcap=softcap, hard_label_weight=hlw, tail=tail)
    out = fd.vocab_parallel_topk_distillation_loss(xs, ids, lp, target, reduction=reduction, return_stats=stats,
                                                   **kw)
    single = fusedce.topk_distillation_loss(x.detach(), ids, lp, target, reduction=reduction, return_stats=stats,
                                            backend="torch", **kw)
    x64 = x.detach().double().requires_grad_()
    ref = _expected(x64, ids, lp, target, reduction, temperature=temperature, softcap=softcap,
                    hard_label_weight=hlw, tail=tail)
    _compare("logits", out, single, ref, _masses64(x64.detach(), ids, lp, target, temperature, softcap), stats)
    up = torch.randn(ref.shape)
    ((out.loss if stats else out) * up).sum().backward()
    (ref * up.double()).sum().backward()
    g_ref = x64.grad[..., cols]
    assert xs.grad.dtype == dtype and xs.grad.shape == xs.shape
    _within("logits grad", xs.grad, g_ref, GRAD_MAX_RTOL * float(x64.grad.abs().max()))
    assert bool((xs.grad[target == -100] == 0).all()), "grad of ignored tokens"


@check
def logits_form(rank, world):
    for case in LOGIT_CASES:
        _logits_case(rank, SIZES[world], case)


@check
def logits_form_with_an_empty_slice(rank, world):
    _logits_case(rank, EMPTY[world], LOGIT_CASES[1])


def _linear_case(rank, sizes, bias, chunk_size, tail, stats, temperature, hlw):
    ids, lp, target = _teacher()
    h, W = torch.randn(*SHAPE, H), torch.randn(V, H) * 0.7
    b = torch.randn(V) if bias else None
    cols = _cols(rank, sizes)
    leaves = [h.clone().requires_grad_(), W[cols].clone().requires_grad_()]
    if bias:
        leaves.append(b[cols].clone().requires_grad_())
    kw = dict(temperature=temperature, hard_label_weight=hlw, tail=tail, return_stats=stats, reduction="mean")
    out = fd.vocab_parallel_linear_topk_distillation_loss(leaves[0], leaves[1], ids, lp, target,
                                                          bias_shard=leaves[2] if bias else None,
                                                          chunk_size=chunk_size, **kw)
    single = fusedce.linear_topk_distillation_loss(h, W, ids, lp, target, student_bias=b, backend="torch", **kw)
    full = [h.double().requires_grad_(), W.double().requires_grad_()] + ([b.double().requires_grad_()]
                                                                        if bias else [])
    x64 = torch.nn.functional.linear(*full)
    ref = _expected(x64, ids, lp, target, "mean", temperature=temperature, hard_label_weight=hlw, tail=tail)
    _compare("linear", out, single, ref, _masses64(x64.detach(), ids, lp, target, temperature, None), stats)
    (out.loss if stats else out).backward()
    ref.backward()
    refs = [full[0].grad, full[1].grad[cols]] + ([full[2].grad[cols]] if bias else [])
    for label, leaf, g_ref, whole in zip(("student_hidden", "weight_shard", "bias_shard"), leaves, refs, full):
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape, label
        _within(f"linear grad {label}", leaf.grad, g_ref, LINEAR_MAX_RTOL * float(whole.grad.abs().max()))


@check
def linear_form(rank, world):
    sizes = SIZES[world]
    _linear_case(rank, sizes, True, None, False, True, 1.0, 0.0)
    _linear_case(rank, sizes, True, 4, True, True, 2.0, 0.5)   # partial last chunk, second pass, tail
    _linear_case(rank, sizes, False, 4, True, False, 1.0, 0.7)


@check
def linear_form_with_an_empty_slice(rank, world):
    _linear_case(rank, EMPTY[world], True, None, True, True, 1.0, 0.5)


@check
def exchanges_row_statistics_only(rank, world):
    """No collective carries a logits row: with V = 64 (BT x V_r >= 192 elements per rank), every tensor
    all-reduced or all-gathered by both forms (forward and backward, tail and hard label on) has at most
    BT x (K + 1) elements (the K classes' logits and the hard label's), or BT x H (``grad_hidden``)."""
    v = 64
    ids, lp, target = _teacher()
    sizes = [v // world + (r < v % world) for r in range(world)]
    cols = _cols(rank, sizes)
    seen = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def spy(name):
        def call(tensor, *args, **kwargs):
            seen.append(sum(t.numel() for t in tensor) if isinstance(tensor, list) else tensor.numel())
            return real[name](tensor, *args, **kwargs)
        return call

    x = torch.randn(*SHAPE, v)[..., cols].clone().requires_grad_()
    h, W = torch.randn(*SHAPE, H).requires_grad_(), (torch.randn(v, H)[cols] * 0.7).requires_grad_()
    try:
        for name in real:
            setattr(dist, name, spy(name))
        fd.vocab_parallel_topk_distillation_loss(x, ids, lp, target, tail=True, hard_label_weight=0.5,
                                                 temperature=2.0).backward()
        fd.vocab_parallel_linear_topk_distillation_loss(h, W, ids, lp, target, tail=True,
                                                        hard_label_weight=0.5).backward()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    bt = SHAPE[0] * SHAPE[1]
    assert seen and max(seen) <= max(bt * (K + 1), bt * H) < bt * min(sizes), seen


def _raises(exc, match, fn):
    try:
        fn()
    except exc as e:
        assert match in str(e), f"{exc.__name__} without {match!r}: {e}"
    else:
        raise AssertionError(f"expected {exc.__name__} ({match!r})")


@check
def bad_inputs(rank, world):
    """The same clear error on every rank, before any loss is computed: a teacher id outside the GLOBAL
    [0, V) (an id of another rank's slice is valid), a target outside it, slices that do not tile [0, V),
    an LM-head shard of the wrong hidden size, ``tail`` not a bool, a teacher K differing between ranks."""
    sizes, cols = SIZES[world], _cols(rank, SIZES[world])
    ids, lp, target = _teacher()
    x = torch.randn(*SHAPE, V)[..., cols]
    h, W = torch.randn(*SHAPE, H), torch.randn(V, H)[cols]
    vp, lin = fd.vocab_parallel_topk_distillation_loss, fd.vocab_parallel_linear_topk_distillation_loss
    bad = ids.clone()
    bad[1, 2, 1] = V
    _raises(IndexError, f"teacher_ids[1, 2, 1] = {V}", lambda: vp(x, bad, lp, target))
    _raises(IndexError, f"teacher_ids[1, 2, 1] = {V}", lambda: lin(h, W, bad, lp, target, tail=True))
    bad_t = target.clone()
    bad_t[2, 2] = V
    _raises(IndexError, "target", lambda: vp(x, ids, lp, bad_t, hard_label_weight=1.0))
    _raises(ValueError, "tile", lambda: vp(x, ids, lp, target, vocab_start_index=0))
    _raises(ValueError, "student_hidden.shape[-1]", lambda: lin(h, torch.randn(sizes[rank], H + 1), ids, lp))
    _raises(TypeError, "tail", lambda: vp(x, ids, lp, target, tail=1))
    _raises(ValueError, "(..., K)", lambda: vp(x, ids[..., None], lp[..., None], target))
    if rank == world - 1:   # one rank's teacher with another K: refused on every rank in the setup exchange
        ids, lp = torch.cat([ids, ids[..., :1]], -1), torch.cat([lp, lp[..., :1]], -1)
    _raises(ValueError, "must be the same on every rank", lambda: vp(x, ids, lp, target))
    _raises(ValueError, "must be the same on every rank", lambda: lin(h, W, ids, lp, target))
    dist.barrier()


@check
def dtensor_route(rank, world):
    """``fusedce.topk_distillation_loss`` / ``linear_topk_distillation_loss`` with a vocabulary-sharded
    DTensor (logits ``Shard(-1)``, head ``Shard(0)``) run these ops: a replicated loss equal to the
    single-process one, the shard's gradient a DTensor whose full tensor is the single-process gradient."""
    from torch.distributed import tensor as dt
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    ids, lp, target = _teacher()
    x, h, W = torch.randn(*SHAPE, V), torch.randn(*SHAPE, H), torch.randn(V, H) * 0.7
    full = x.clone().requires_grad_()
    expected = fusedce.topk_distillation_loss(full, ids, lp, target, tail=True)
    expected.backward()
    xs = dt.distribute_tensor(x, mesh, [dt.Shard(2)]).requires_grad_()
    loss = fusedce.topk_distillation_loss(xs, ids, lp, target, tail=True)
    loss.backward()
    assert isinstance(loss, dt.DTensor) and loss.placements[0].is_replicate()
    _within("dtensor loss", loss.to_local(), expected, OUT_RTOL * max(1.0, float(expected.abs())))
    _within("dtensor grad", xs.grad.full_tensor(), full.grad, GRAD_MAX_RTOL * float(full.grad.abs().max()))
    full_w = W.clone().requires_grad_()
    expected = fusedce.linear_topk_distillation_loss(h, full_w, ids, lp, target, tail=True)
    expected.backward()
    w = dt.distribute_tensor(W, mesh, [dt.Shard(0)]).requires_grad_()
    loss = fusedce.linear_topk_distillation_loss(h, w, ids, lp, target, tail=True, method="auto")
    loss.backward()
    _within("dtensor linear loss", loss.to_local(), expected, OUT_RTOL * max(1.0, float(expected.abs())))
    _within("dtensor linear grad", w.grad.full_tensor(), full_w.grad,
            LINEAR_MAX_RTOL * float(full_w.grad.abs().max()))
    _raises(ValueError, "method='tiled'",
            lambda: fusedce.linear_topk_distillation_loss(h, w, ids, lp, target, method="tiled"))


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CHECKS))
@over_worlds
def test_vocab_parallel_topk_distillation(world, backend, name, request, tmp_path_factory):
    """Every check on 2 and 3 gloo ranks (``dist_harness.WORLD_BACKENDS``: the Triton kernels on 2)."""
    outcome = results(__name__, CHECKS, world, backend, request, tmp_path_factory)[name]
    assert_passed(outcome, world)
