"""Per-token loss weights ``token_weights`` (the contract's last section): each non-ignored row's loss and
z-loss times its weight (after ``use_token_scaling``'s ``p_t``), a constant (no gradient), the mean's
denominators unchanged; on ``cross_entropy``, ``linear_cross_entropy`` (both methods), the modules, the
vocab-parallel ops and the Hugging Face patch, on every backend of this machine.

The oracle is the shared float64 one (``tests/support/reference64.py``, ``reference_loss``):
``F.cross_entropy(reduction="none")`` per row (class weights, smoothing), ``+ s lse**2``, both times ``tw``
(and the detached ``p_t``), ``"mean"`` dividing by ``D = sum w[t]`` / ``N`` = the count of non-ignored rows
(or ``num_items_in_batch``). Gradients by float64 autograd through it (per-token and non-unit upstream
gradients).

Shapes: V = 45 / 70 classes (not powers of two), (3, 7) = 21 tokens with every 4th ignored (the ignored
rows hold NaN weights: they must not matter), chunk_size 8 (three chunks, a partial last one). Weights
span [-1, 3) with one exact 0 (reward-weighted SFT has negative weights). Tolerance: fp32 paths against
float64, ``LINEAR_MAX_RTOL`` of each value plus ``LINEAR_MAX_RTOL`` of the tensor's largest magnitude (a few hundred
fp32 ulps;
a missing or doubled weight is an O(1) error).
"""
from __future__ import annotations

import json
import os
import re
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedce
import fusedce.distributed as fd
from fusedce.lm_head import head
from fusedce.core import validation
from inputs import make_logits, make_target, make_weight
from reference64 import reference_loss
from tolerances import LINEAR_MAX_RTOL

NAN = float("nan")
SHAPE, H, V = (3, 7), 16, 45
OPTIONS = {
    "plain": {},
    "dft": {"use_token_scaling": True},
    "all": {"use_token_scaling": True, "label_smoothing": 0.1, "lse_square_scale": 1e-2, "softcap": 6.0,
            "logit_scale": 1.5, "weighted": True},
    "weighted+z": {"lse_square_scale": 1e-2, "weighted": True, "num_items_in_batch": 11},
}


def token_weights(target, ignore_index=-100):
    """Weights in [-1, 3), one exact 0, NaN on every ignored row."""
    tw = torch.rand(target.shape) * 4.0 - 1.0
    tw.view(-1)[2] = 0.0   # a kept row (make_target ignores flat 1, 5, 9, ...)
    return torch.where(target == ignore_index, NAN, tw)


def near(name, actual, expected, rtol=LINEAR_MAX_RTOL):
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{name}: not finite"
    bound = rtol * (e.abs() + e.abs().max().clamp_min(1e-30))
    diff = (a - e).abs()
    assert bool((diff <= bound).all()), f"{name}: max |diff| {float(diff.max()):.3e}, bound {float(bound.max()):.3e}"


def upstream(reduction, shape=SHAPE):
    return torch.randn(shape) if reduction == "none" else torch.tensor(1.7)


def split(kw):
    kw = dict(kw)
    return kw.pop("weighted", False), kw


# ------------------------------------------------------------------------------------------ functions
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", list(OPTIONS))
def test_cross_entropy(backend, options, reduction):
    weighted, kw = split(OPTIONS[options])
    x = make_logits((*SHAPE, 70), torch.float32, scale=3.0)
    t = make_target(SHAPE, 70, ignore_every=4)
    cw = make_weight(70) if weighted else None
    tw = token_weights(t)
    up = upstream(reduction)
    out = fusedce.cross_entropy(x, t, cw, reduction=reduction, backend=backend, return_stats=True,
                                token_weights=tw, **kw)
    (grad,) = torch.autograd.grad(out.loss, x, up)
    x64 = x.detach().double().requires_grad_()
    loss, z_loss = reference_loss(x64, t, cw, token_weights=tw, reduction=reduction, **kw)
    (grad64,) = torch.autograd.grad(loss, x64, up.double())
    near("loss", out.loss, loss)
    near("z_loss", out.z_loss, z_loss)
    near("grad", grad, grad64)
    assert bool((grad.reshape(-1, 70)[t.reshape(-1) == -100] == 0).all()), "ignored rows: exactly 0"


def linear_inputs(bias=True):
    hidden = torch.randn(*SHAPE, H, requires_grad=True)
    weight = (torch.randn(V, H) * H ** -0.5 * 2.0).requires_grad_()
    b = (torch.randn(V) * 0.5).requires_grad_() if bias else None
    return hidden, weight, b, make_target(SHAPE, V, ignore_every=4)


def check_linear(backend, method, reduction, kw, chunk_size=None, dtype=torch.float32, rtol=LINEAR_MAX_RTOL):
    weighted, kw = split(kw)
    hidden, weight, bias, t = linear_inputs()
    leaves = [p.detach().to(dtype).requires_grad_() for p in (hidden, weight, bias)]
    cw = make_weight(V) if weighted else None
    tw = token_weights(t)
    up = upstream(reduction)
    out = fusedce.linear_cross_entropy(*leaves[:2], t, leaves[2], ce_weight=cw, reduction=reduction,
                                       method=method, chunk_size=chunk_size, backend=backend, return_stats=True,
                                       token_weights=tw, **kw)
    grads = torch.autograd.grad(out.loss, leaves, up)
    leaves64 = [p.detach().double().requires_grad_() for p in leaves]
    loss, z_loss = reference_loss(F.linear(*leaves64), t, cw, token_weights=tw, reduction=reduction, **kw)
    grads64 = torch.autograd.grad(loss, leaves64, up.double())
    near("loss", out.loss, loss, rtol)
    near("z_loss", out.z_loss, z_loss, rtol)
    for name, g, e in zip(("hidden", "weight", "bias"), grads, grads64):
        assert g.dtype == dtype
        near(f"grad_{name}", g, e, rtol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("method", ["chunked", "tiled"])
@pytest.mark.parametrize("options", list(OPTIONS))
def test_linear_cross_entropy(backend, options, method, reduction):
    check_linear(backend, method, reduction, OPTIONS[options], chunk_size=8 if method == "chunked" else None)


def test_linear_second_backward_recomputes_with_the_weights(backend):
    """mean: the first backward scales the forward-made gradients, a second one (retained graph)
    recomputes them: both carry the weights."""
    hidden, weight, _, t = linear_inputs(bias=False)
    tw = token_weights(t)
    loss = fusedce.linear_cross_entropy(hidden, weight, t, backend=backend, chunk_size=8, token_weights=tw,
                                        lse_square_scale=1e-2)
    first = torch.autograd.grad(loss, (hidden, weight), torch.tensor(0.5), retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight), torch.tensor(0.5))
    for a, b in zip(first, second):
        near("second backward", b, a)


def test_fp16_headroom_includes_the_largest_weight():
    """The chunked method forms its gradients in the forward at a power-of-two headroom P sized by the
    largest per-logit gradient (``lm_head/head.py``); a weight of 2^12 on one row must lower P, or that
    row's fp16 gradient overflows (inf) before the backward divides by P."""
    hidden, weight, _, t = linear_inputs(bias=False)
    tw = torch.rand(SHAPE) + 0.5
    tw[0, 2] = 2.0 ** 12
    assert int(t[0, 2]) != -100
    leaves = [p.detach().half().requires_grad_() for p in (hidden, weight)]
    loss = fusedce.linear_cross_entropy(*leaves, t, backend="torch", chunk_size=8, token_weights=tw)
    grads = torch.autograd.grad(loss, leaves)
    leaves64 = [p.detach().double().requires_grad_() for p in leaves]
    loss64 = reference_loss(F.linear(*leaves64), t, None, token_weights=tw)[0]
    grads64 = torch.autograd.grad(loss64, leaves64)
    for name, g, e in zip(("hidden", "weight"), grads, grads64):
        near(f"fp16 grad_{name}", g, e, rtol=2.0 ** -8)


def test_no_compaction_ignored_rows_and_non_finite_weights(backend, monkeypatch):
    """Under torch.compile / CUDA-graph capture (no host sync) every row goes through the kernels and the
    value check is skipped: NaN weights on ignored rows still change nothing; a NaN weight on a kept
    row propagates into the loss and that row's hidden gradient only (as stock's composition)."""
    monkeypatch.setattr(head, "host_readable", lambda *tensors: False)
    monkeypatch.setattr(validation, "host_readable", lambda *tensors: False)
    check_linear(backend, "chunked", "mean", OPTIONS["all"], chunk_size=8)
    hidden, weight, _, t = linear_inputs(bias=False)
    tw = token_weights(t)
    tw[1, 3] = NAN
    assert int(t[1, 3]) != -100
    loss = fusedce.linear_cross_entropy(hidden, weight, t, backend=backend, chunk_size=8, token_weights=tw)
    (g_h,) = torch.autograd.grad(loss, hidden)
    assert loss.isnan()
    nan_rows = g_h.isnan().any(dim=-1)
    assert bool(nan_rows[1, 3]) and int(nan_rows.sum()) == 1, nan_rows


def test_no_gradient_to_the_weights(backend):
    """A ``token_weights`` that requires grad is taken as a constant (detached, as class weights)."""
    x = make_logits((*SHAPE, 30), torch.float32)
    t = make_target(SHAPE, 30, ignore_every=4)
    tw = torch.rand(SHAPE, requires_grad=True)
    loss = fusedce.cross_entropy(x, t, backend=backend, token_weights=tw)
    loss.backward()
    assert tw.grad is None and x.grad is not None
    hidden, weight, _, t = linear_inputs(bias=False)
    tw = torch.rand(SHAPE, requires_grad=True)
    fusedce.linear_cross_entropy(hidden, weight, t, backend=backend, token_weights=tw).backward()
    assert tw.grad is None and hidden.grad is not None


def test_inputs_untouched_and_ones_change_nothing(backend):
    """Weights of 1 give the unweighted loss bit for bit; the caller's weights are not modified."""
    x = make_logits((*SHAPE, 30), torch.float32)
    t = make_target(SHAPE, 30, ignore_every=4)
    tw = torch.where(t == -100, NAN, 1.0)
    before = tw.clone()
    for kw in ({}, {"use_token_scaling": True, "lse_square_scale": 1e-2}):
        a = fusedce.cross_entropy(x, t, backend=backend, token_weights=tw, **kw)
        b = fusedce.cross_entropy(x, t, backend=backend, **kw)
        assert torch.equal(a, b)
    assert torch.equal(tw.isnan(), before.isnan()) and torch.equal(tw.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_errors(op):
    hidden, weight, _, t = linear_inputs(bias=False)
    x = make_logits((*SHAPE, V), torch.float32)

    def call(tw, **kw):
        if op == "cross_entropy":
            return fusedce.cross_entropy(x, t, token_weights=tw, **kw)
        return fusedce.linear_cross_entropy(hidden, weight, t, token_weights=tw, **kw)
    with pytest.raises(TypeError, match="token_weights"):
        call(torch.ones(SHAPE, dtype=torch.int64))
    with pytest.raises(TypeError, match="token_weights"):
        call([1.0] * 21)
    with pytest.raises(ValueError, match="token_weights shape"):
        call(torch.ones(21))
    with pytest.raises(ValueError, match="token_weights is on meta"):
        call(torch.ones(SHAPE, device="meta"))
    kept = (t != -100).nonzero()[2].tolist()
    for bad in (NAN, float("inf"), -float("inf")):
        tw = torch.ones(SHAPE)
        tw[tuple(kept)] = bad
        with pytest.raises(ValueError, match=re.escape(f"token_weights{kept} = {bad}")):
            call(tw)
    with pytest.raises(ValueError, match="non-ignored"):   # fp64 beyond fp32: infinite once in fp32
        call(torch.full(SHAPE, 1e300, dtype=torch.float64))
    bad_target = t.clone()
    bad_target[tuple(kept)] = V + 3   # the target error comes first
    with pytest.raises(IndexError):
        (fusedce.cross_entropy(x, bad_target, token_weights=torch.full(SHAPE, NAN)) if op == "cross_entropy" else
         fusedce.linear_cross_entropy(hidden, weight, bad_target, token_weights=torch.full(SHAPE, NAN)))


def test_modules(backend):
    x = make_logits((*SHAPE, 30), torch.float32)
    t = make_target(SHAPE, 30, ignore_every=4)
    tw = token_weights(t)
    module = fusedce.CrossEntropyLoss(lse_square_scale=1e-2, backend=backend, use_token_scaling=True)
    assert torch.equal(module(x, t, token_weights=tw),
                       fusedce.cross_entropy(x, t, lse_square_scale=1e-2, backend=backend, use_token_scaling=True,
                                             token_weights=tw))
    hidden, weight, bias, t = linear_inputs()
    tw = token_weights(t)
    module = fusedce.LinearCrossEntropyLoss(reduction="sum", backend=backend, chunk_size=8)
    got = module(hidden, weight, t, bias, token_weights=tw)
    leaves64 = [p.detach().double() for p in (hidden, weight, bias)]
    near("module", got, reference_loss(F.linear(*leaves64), t, None, token_weights=tw, reduction="sum")[0])


# ------------------------------------------------------------------------------------------ vocab-parallel
SIZES = (20, 25)   # V = 45 split unevenly over 2 ranks


def _distributed_checks(rank, backend):
    cols = slice(0, SIZES[0]) if rank == 0 else slice(SIZES[0], V)
    for reduction in ("mean", "none"):
        for kw in ({}, {"use_token_scaling": True, "label_smoothing": 0.1, "lse_square_scale": 1e-2}):
            x = make_logits((*SHAPE, V), torch.float32, scale=3.0)
            t = make_target(SHAPE, V, ignore_every=4)
            tw = token_weights(t)
            up = upstream(reduction)
            xs = x.detach()[..., cols].clone().requires_grad_()
            loss = fd.vocab_parallel_cross_entropy(xs, t, reduction=reduction, backend=backend, token_weights=tw,
                                                   **kw)
            (grad,) = torch.autograd.grad(loss, xs, up)
            x64 = x.detach().double().requires_grad_()
            loss64 = reference_loss(x64, t, None, token_weights=tw, reduction=reduction, **kw)[0]
            (grad64,) = torch.autograd.grad(loss64, x64, up.double())
            near(f"vp ce loss {reduction} {kw}", loss, loss64)
            near(f"vp ce grad {reduction} {kw}", grad, grad64[..., cols])

            hidden, weight, bias, t = linear_inputs()
            leaves = [hidden, weight.detach()[cols].clone().requires_grad_(),
                      bias.detach()[cols].clone().requires_grad_()]
            loss = fd.vocab_parallel_linear_cross_entropy(*leaves[:2], t, leaves[2], reduction=reduction,
                                                          backend=backend, chunk_size=8, token_weights=tw, **kw)
            grads = torch.autograd.grad(loss, leaves, up)
            leaves64 = [p.detach().double().requires_grad_() for p in (hidden, weight, bias)]
            loss64 = reference_loss(F.linear(*leaves64), t, None, token_weights=tw, reduction=reduction, **kw)[0]
            grads64 = torch.autograd.grad(loss64, leaves64, up.double())
            near(f"vp linear loss {reduction} {kw}", loss, loss64)
            for name, g, e in zip(("hidden", "weight", "bias"), grads, (grads64[0], grads64[1][cols],
                                                                        grads64[2][cols])):
                near(f"vp linear grad_{name} {reduction} {kw}", g, e)


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    results = {}
    try:
        for backend in ("torch", "triton"):
            torch.manual_seed(1234)   # the same inputs on both ranks
            try:
                _distributed_checks(rank, backend)
                results[backend] = None
            except Exception:  # noqa: BLE001 - reported by the test
                results[backend] = traceback.format_exc()
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def test_vocab_parallel(tmp_path):
    """Both vocab-parallel ops on 2 gloo ranks (V = 20 + 25), torch and triton (interpreter) backends,
    against the float64 formula on the concatenated vocabulary."""
    from dist_harness import _free_port, start_ranks
    start_ranks(_worker, (_free_port(), str(tmp_path)), 2)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(results) == {"torch", "triton"}, results
        failed = {k: v for k, v in results.items() if v is not None}
        assert not failed, "\n".join(f"--- rank {rank} {k} ---\n{v}" for k, v in failed.items())


# ------------------------------------------------------------------------------------------ Hugging Face
def test_hf_patch_matches_weighted_stock_loss():
    """patch_causal_lm with ``token_weights`` (B, T) as a forward keyword, against the stock model's own
    logits: per-token ``F.cross_entropy(reduction="none")`` on the shifted labels times the shifted
    weights, summed, over the count of non-ignored tokens (or ``num_items_in_batch``); every parameter's
    gradient. Also with ``shift_labels`` (weights aligned with them as given) and with token scaling."""
    pytest.importorskip("transformers")
    import copy

    from hf_models import assert_close, batch, build
    stock = build("llama")
    fused = fusedce.patch_causal_lm(copy.deepcopy(stock))
    ids, mask, labels = batch()
    weights = torch.rand(labels.shape) * 2.0
    weights[labels == -100] = NAN   # never read

    def stock_loss(shifted, w_shifted, num_items=None, dft=False):
        logits = stock(input_ids=ids, attention_mask=mask).logits.float()
        rows = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), reduction="none")
        kept = shifted.reshape(-1) != -100
        f = torch.where(kept, w_shifted.reshape(-1), 0.0)
        if dft:
            f = f * torch.exp(-rows).detach()
        total = torch.where(kept, rows * f, 0.0).sum()
        return total / (kept.sum() if num_items is None else num_items)

    def grads(model, loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    w_shifted = F.pad(weights, (0, 1))[..., 1:]
    cases = [({"labels": labels, "token_weights": weights}, (shifted, w_shifted)),
             ({"labels": labels, "token_weights": weights, "num_items_in_batch": 7, "use_token_scaling": True},
              (shifted, w_shifted, 7, True)),
             ({"labels": labels, "shift_labels": shifted, "token_weights": w_shifted}, (shifted, w_shifted))]
    for kwargs, ref_args in cases:
        ref = stock_loss(*ref_args)
        ref_grads = grads(stock, ref)
        out = fused(input_ids=ids, attention_mask=mask, **kwargs)
        got = grads(fused, out.loss)
        assert_close(out.loss, ref, "loss")
        assert got.keys() == ref_grads.keys()
        for name, g in got.items():
            assert_close(g, ref_grads[name], name)
    with pytest.raises(ValueError, match="token_weights shape"):
        fused(input_ids=ids, attention_mask=mask, labels=labels, token_weights=weights[:, :-1])
    with pytest.raises(ValueError, match="pass labels"):
        fused(input_ids=ids, attention_mask=mask, token_weights=weights)
    assert "token_weights" not in fusedce.integrations.hf.patch.LOSS_OPTIONS   # a per-call keyword
