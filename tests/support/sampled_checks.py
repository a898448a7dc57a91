"""Checks of ``vocab_parallel_linear_token_log_probs`` with ``return_stats`` (Σπ² = ``exp(log_sum_sq_probs)``),
``logits_dtype="input"`` and ``top_k`` / ``top_p`` (issue 45: the verl Megatron route's remaining options), each
against float64 of the concatenated head and the single-process op on it, gradients included. They run in
``tests/distributed/test_distributed_log_probs.py``'s spawned groups (2 and 3 gloo ranks, each backend: the
PyTorch row path under test is the same on every backend), merged into its ``CHECKS`` (no spawn of their own).

Shapes as there: V = 11 split 5 + 6 / 3 + 4 + 4, (3, 4) = 12 tokens, every 4th ignored, H = 8; chunk_size None
(one chunk) and 4 (a partial last chunk, so the per-chunk collectives pair up over several chunks). Head rows 3
and 8 (on different ranks) equal, so every row has a tie across the ranks; per-row ``top_k`` puts the boundary
on it.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedce
import fusedce.distributed as fd
from inputs import make_target
from reference64_log_probs import reference_log_probs, transformed_logits
from tolerances import LINEAR_MAX_RTOL, VP_GRAD_MAX_RTOL, VP_GRAD_RTOL
import truncated_reference64 as tr64

V, SHAPE, H, TIE = 11, (3, 4), 8, (3, 8)
SIZES = {2: (5, 6), 3: (3, 4, 4)}
CHECKS = {}


def check(fn):
    CHECKS[f"sampled_{fn.__name__}"] = fn
    return fn


def _cols(rank):
    sizes = SIZES[dist.get_world_size()]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _within(name, actual, expected, bound):
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    same_inf = (a == e) & a.isinf()
    diff = torch.where(same_inf, 0.0, (a - e).abs())
    bad = ~(diff <= bound)   # NaN is bad
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} elements off, max |diff| {float(diff.max()):.3e}"


def _grad_bound(ref, dtype):
    return VP_GRAD_RTOL[dtype] * ref.abs() + max(VP_GRAD_MAX_RTOL, LINEAR_MAX_RTOL) * ref.abs().max().clamp_min(1e-30)


def _head(dtype=torch.float32):
    h = torch.randn(*SHAPE, H)
    W = torch.randn(V, H) * 0.7
    b = torch.randn(V)
    W[TIE[1]], b[TIE[1]] = W[TIE[0]], b[TIE[0]]   # a tie across the ranks in every row
    return h.to(dtype), W.to(dtype), b.to(dtype)


def _leaves(rank, h, W, b):
    cols = _cols(rank)
    return [h.clone().requires_grad_(), W[cols].clone().requires_grad_(), b[cols].clone().requires_grad_()]


def _grads_vs(name, leaves, full, x64, rank):
    """The three gradients vs float64 (``full`` the float64 leaves, ``x64`` their logits, grad retained)."""
    cols, dtype = _cols(rank), leaves[0].dtype
    refs = [full[0].grad, full[1].grad[cols], full[2].grad[cols]]
    for what, leaf, ref in zip(("hidden", "weight_shard", "bias_shard"), leaves, refs):
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape, what
        bound = _grad_bound(ref, dtype)
        if dtype != torch.float32:
            g = x64.grad.reshape(-1, V).abs()
            bound = bound + {"hidden": lambda: _hidden_bound(x64.grad, full[1].detach()),
                             "weight_shard": lambda: 2.0 ** -7 * (g.T @ full[0].detach().reshape(-1, H).abs())[cols],
                             "bias_shard": lambda: 2.0 ** -7 * g.sum(0)[cols]}[what]()
        _within(f"{name} grad {what}", leaf.grad, ref, bound)


def _hidden_bound(g_x64, W64):
    """bf16 gradients are products with ``g`` (the logits' gradient) rounded to bf16 per element, and hidden's,
    ``g @ W``, has each rank's partial ``g_r @ W_r`` rounded before their sum: at most three roundings of 2^-9
    of ``|g| @ |W|`` (the weight's and bias's: of ``|g|.T @ |h|``, ``|g|.sum(0)``)."""
    return 2.0 ** -7 * (g_x64.abs() @ W64.abs())


# ---------------------------------------------------------------------------------------- checks
@check
def sum_pi_squared(rank, world):
    """``return_stats``: Σπ² (``log_sum_sq_probs``), ``mean_logits``, ``is_top1`` equal float64 and the
    single-process op's; log-probs, entropy and the three gradients as without stats; fp32 and bf16 heads,
    temperature / softcap, entropy both ways, chunk_size None and 4."""
    cols = _cols(rank)
    t = make_target(SHAPE, V, ignore_every=4)
    t[0, 1] = TIE[1]            # the tie's second class: not a top-1 hit even when the tie is the max
    for dtype, (temperature, softcap), return_entropy, chunk_size in (
            (torch.float32, (1.0, None), True, None), (torch.float32, (2.0, 3.0), False, 4),
            (torch.bfloat16, (0.7, None), True, 4)):
        h, W, b = _head(dtype)
        leaves = _leaves(rank, h, W, b)
        out = fd.vocab_parallel_linear_token_log_probs(*leaves[:2], t, leaves[2], temperature=temperature,
                                                       softcap=softcap, return_entropy=return_entropy,
                                                       return_stats=True, chunk_size=chunk_size)
        assert isinstance(out, fusedce.TokenStats) and (out.entropy is None) != return_entropy
        full = [h.double().requires_grad_(), W.double().requires_grad_(), b.double().requires_grad_()]
        x64 = F.linear(*full)
        x64.retain_grad()
        ref_lp, ref_ent = reference_log_probs(x64, t, temperature, softcap)
        q = transformed_logits(x64.detach(), temperature, softcap)
        valid = t != -100
        ref_sq = torch.where(valid, torch.logsumexp(2 * q, -1) - 2 * torch.logsumexp(q, -1), 0.0)
        ref_mean = torch.where(valid, q.mean(-1), 0.0)
        bound = LINEAR_MAX_RTOL * max(float(q.abs().max()), 1.0)
        _within("log_sum_sq_probs", out.log_sum_sq_probs, ref_sq, bound)
        _within("mean_logits", out.mean_logits, ref_mean, bound)
        assert out.is_top1.dtype == torch.bool and bool((out.is_top1[~valid] == 0).all())
        single = fusedce.linear_token_log_probs(h, W, t, b, temperature=temperature, softcap=softcap,
                                                return_entropy=return_entropy, return_stats=True, backend="torch",
                                                chunk_size=chunk_size)
        assert torch.equal(out.is_top1, single.is_top1), "is_top1 vs single-process"
        for name in ("log_probs", "log_sum_sq_probs", "mean_logits") + (("entropy",) if return_entropy else ()):
            _within(f"{name} vs single-process", getattr(out, name), getattr(single, name), 2 * bound)
        _within("log_probs", out.log_probs, ref_lp, bound)
        up_lp, up_ent = torch.randn(SHAPE), torch.randn(SHAPE)
        obj = (up_lp * out.log_probs).sum() + ((up_ent * out.entropy).sum() if return_entropy else 0.0)
        obj.backward()
        ((up_lp.double() * ref_lp).sum() + ((up_ent.double() * ref_ent).sum() if return_entropy else 0.0)).backward()
        _grads_vs("stats", leaves, full, x64, rank)
    # a tie for the max between the ranks: the lower class id is the top-1 (as the single-process op)
    h, W, b = _head()
    W[TIE[0]] = W[TIE[1]] = torch.zeros(H)
    b[TIE[0]] = b[TIE[1]] = 50.0
    t2 = torch.tensor([[TIE[0], TIE[1], 0, -100]] * 3)
    out = fd.vocab_parallel_linear_token_log_probs(h, W[cols], t2, b[cols], return_stats=True)
    assert out.is_top1.tolist() == [[True, False, False, False]] * 3, out.is_top1


@check
def logits_dtype_input(rank, world):
    """``logits_dtype="input"`` on bf16: the logits rounded to bf16 (``F.linear``'s), then fp32: equal to float64
    of those rounded logits and to the single-process op (values and hidden's gradient within bf16's
    rounding of the gradient), and not the fp32-logits result."""
    cols = _cols(rank)
    t = make_target(SHAPE, V, ignore_every=4)
    for chunk_size, return_entropy in ((None, True), (4, False)):
        h, W, b = _head(torch.bfloat16)
        h = h * 4   # logits O(10): bf16's rounding of them (~0.03) far above fp32's
        leaves = _leaves(rank, h, W, b)
        out = fd.vocab_parallel_linear_token_log_probs(*leaves[:2], t, leaves[2], temperature=0.9,
                                                       return_entropy=return_entropy, logits_dtype="input",
                                                       chunk_size=chunk_size)
        rounded = F.linear(h, W, b).double().requires_grad_()   # torch's bf16 logits (identical products, H = 8)
        ref_lp, ref_ent = reference_log_probs(rounded, t, 0.9, None)
        lp = out.log_probs if return_entropy else out
        bound = LINEAR_MAX_RTOL * max(float(rounded.abs().max()), 1.0)
        _within("input log_probs", lp, ref_lp, bound)
        if return_entropy:
            _within("input entropy", out.entropy, ref_ent, bound)
        exact = fd.vocab_parallel_linear_token_log_probs(h, W[cols], t, b[cols], temperature=0.9)
        assert float((exact - lp.detach()).abs().max()) > 100 * bound, "logits_dtype='input' had no effect"
        single = fusedce.linear_token_log_probs(h.clone().requires_grad_(), W, t, b, temperature=0.9,
                                                return_entropy=return_entropy, logits_dtype="input",
                                                backend="torch", chunk_size=chunk_size)
        for a, s in zip(out if return_entropy else (out,), single if return_entropy else (single,)):
            _within("input vs single-process", a, s, 2 * bound)
        up = torch.randn(SHAPE)
        (up * lp).sum().backward()
        (up.double() * ref_lp).sum().backward()
        ref_h = rounded.grad @ W.double()
        bound = _grad_bound(ref_h, torch.bfloat16) + _hidden_bound(rounded.grad, W.double())
        _within("input grad hidden", leaves[0].grad, ref_h, bound)
        h1 = h.clone().requires_grad_()
        single = fusedce.linear_token_log_probs(h1, W, t, b, temperature=0.9, logits_dtype="input",
                                                backend="torch", chunk_size=chunk_size)
        (up * single).sum().backward()
        _within("input grad hidden vs single-process", leaves[0].grad, h1.grad, 2 * bound)


def _tie_k(x64, t):
    """Per-row top_k (n,) putting the boundary on the tie: the number of classes >= the tied value (so the
    k-th largest is the first of the tied pair, and both are kept)."""
    tie = x64[:, TIE[0]]
    return (x64 > tie[:, None]).sum(dim=1) + 1


def _truncated_case(rank, name, h, W, b, t, top_k, top_p, temperature, softcap, chunk_size, return_entropy=True):
    leaves = _leaves(rank, h, W, b)
    out = fd.vocab_parallel_linear_token_log_probs(*leaves[:2], t, leaves[2], temperature=temperature,
                                                   softcap=softcap, return_entropy=return_entropy, top_k=top_k,
                                                   top_p=top_p, chunk_size=chunk_size)
    full = [h.double().requires_grad_(), W.double().requires_grad_(), b.double().requires_grad_()]
    x64 = F.linear(*full)
    x64.retain_grad()
    n = t.numel()
    ks = top_k.reshape(-1).tolist() if isinstance(top_k, torch.Tensor) else [top_k or 0] * n
    ps = top_p.reshape(-1).tolist() if isinstance(top_p, torch.Tensor) else [1.0 if top_p is None else top_p] * n
    ref_lp, ref_ent = tr64.reference(x64.reshape(n, V), t.reshape(-1), ks, ps, temperature, softcap)
    ref_lp, ref_ent = ref_lp.reshape(SHAPE), ref_ent.reshape(SHAPE)
    lp = out.log_probs if return_entropy else out
    q = transformed_logits(x64.detach(), temperature, softcap)
    bound = LINEAR_MAX_RTOL * max(float(q.abs().max()), 1.0)
    _within(f"{name} log_probs", lp, ref_lp, bound)
    if return_entropy:
        _within(f"{name} entropy", out.entropy, ref_ent, bound)
    single = fusedce.linear_token_log_probs(h, W, t, b, temperature=temperature, softcap=softcap,
                                            return_entropy=return_entropy, top_k=top_k, top_p=top_p,
                                            backend="torch", chunk_size=chunk_size)
    for a, s in zip(out if return_entropy else (out,), single if return_entropy else (single,)):
        _within(f"{name} vs single-process", a, s, 2 * bound)
    up_lp, up_ent = torch.randn(SHAPE), torch.randn(SHAPE)
    finite = ref_lp.detach().isfinite()   # a target outside its kept set: -inf, no gradient
    up_lp = torch.where(finite, up_lp, 0.0)
    obj = (up_lp * torch.where(finite, lp, 0.0)).sum() + ((up_ent * out.entropy).sum() if return_entropy else 0.0)
    obj.backward()
    ref_obj = (up_lp.double() * torch.where(finite, ref_lp, 0.0)).sum() + 0.0 * x64.sum()   # a graph even if
    # every target is outside (then every gradient is zero)
    (ref_obj + ((up_ent.double() * ref_ent).sum() if return_entropy else 0.0)).backward()
    _grads_vs(name, leaves, full, x64, rank)
    return out, ref_lp


@check
def top_k_top_p(rank, world):
    """Scalar and per-row ``top_k`` / ``top_p`` (temperature, top-k, then top-p), alone and together, chunk_size
    None and 4, temperature / softcap: values and gradients vs the float64 sort-free reference and the
    single-process op; rows whose kept set is one class (k = 1, a tiny p) or the whole vocabulary (k = 0,
    p = 1 per row); the boundary on a tie across the ranks (both kept); a target outside its set (-inf)."""
    h, W, b = _head()
    t = make_target(SHAPE, V, ignore_every=4)
    x64 = F.linear(h.double(), W.double(), b.double())
    per_k = _tie_k(x64.reshape(-1, V), t.reshape(-1)).reshape(SHAPE)
    per_k[0, 0], per_k[0, 1] = 0, V            # the whole vocabulary
    per_k[2, 1] = 1                            # one class
    per_p = torch.rand(SHAPE) * 0.8 + 0.15
    per_p[0, 2], per_p[1, 0] = 1.0, 1e-4       # off; one class
    for name, top_k, top_p, (temperature, softcap), chunk_size in (
            ("p scalar", None, 0.8, (2.0, 3.0), 4), ("k and p scalar", 4, 0.6, (0.7, None), None),
            ("k per row (ties)", per_k, None, (1.0, None), 4), ("k and p per row", per_k, per_p, (1.3, 3.0), 4)):
        out, ref_lp = _truncated_case(rank, name, h, W, b, t, top_k, top_p, temperature, softcap, chunk_size)
    # the tie at the boundary: rows with per_k on the tie keep both tied classes (and no other at that value)
    tie_rows = torch.full(SHAPE, TIE[1])
    tie_k = _tie_k(x64.reshape(-1, V), t.reshape(-1)).reshape(SHAPE)
    out, ref_lp = _truncated_case(rank, "tie target", h, W, b, tie_rows, tie_k, None, 1.0, None, None, False)
    assert bool(ref_lp.isfinite().all()) and bool(out.isfinite().all()), "the tied class beyond the k-th kept"
    # a target outside the kept set: -inf (top_k = 1 on a row whose target is not its argmax)
    low = x64.argmin(dim=-1)
    out, _ = _truncated_case(rank, "outside", h, W, b, low, 1, None, 1.0, None, None, False)
    assert bool((out == float("-inf")).all()), out


@check
def ties_and_masks(rank, world):
    """Many ties (logits on a 0.5 grid, a row all equal), per-row top_k (0, 1, beyond V) and top_p (off on some
    rows), classes masked by a -inf bias: the same kept sets as the single-process op (log-probs within fp32
    rounding, -inf where it has -inf), on every split."""
    cols = _cols(rank)
    n = 12
    for _ in range(6):
        x = torch.randint(-6, 7, (n, V)).float() * 0.5
        x[0] = 1.0
        b = torch.zeros(V)
        b[torch.randint(0, V, (3,))] = float("-inf")
        t = torch.randint(0, V, (n,))
        k = torch.randint(0, V + 3, (n,))
        k[1] = 1
        p = torch.rand(n) * 0.95 + 0.03
        p[::4] = 1.0
        W, h = x.T.contiguous(), torch.eye(n)   # logits = h @ W.T + b = x + b exactly
        out = fd.vocab_parallel_linear_token_log_probs(h, W[cols], t, b[cols], return_entropy=True, top_k=k, top_p=p)
        single = fusedce.linear_token_log_probs(h, W, t, b, return_entropy=True, top_k=k, top_p=p, backend="torch")
        _within("ties log_probs", out.log_probs, single.log_probs, 1e-5)
        _within("ties entropy", out.entropy, single.entropy, 1e-5)


@check
def refused(rank, world):
    """What the vocabulary-parallel op cannot do says so: batch_invariant with the PyTorch row path, a
    (..., K) target with logits_dtype='input' or top_k, return_stats with top_p."""
    cols = _cols(rank)
    h, W, b = _head(torch.bfloat16)
    t = make_target(SHAPE, V)
    op = fd.vocab_parallel_linear_token_log_probs
    for kw in ({"top_k": 2}, {"return_stats": True}, {"logits_dtype": "input"}):
        with pytest.raises(ValueError, match="batch_invariant"):
            op(h, W[cols], t, batch_invariant=True, **kw)
    with pytest.raises(ValueError, match="logits_dtype='input'"):
        op(h, W[cols], t[..., None], logits_dtype="input")
    with pytest.raises(ValueError, match="top_k / top_p"):
        op(h, W[cols], t[..., None], top_p=0.5)
    with pytest.raises(ValueError, match="return_stats"):
        op(h, W[cols], t, top_p=0.5, return_stats=True)
    with pytest.raises(ValueError, match="logits_dtype"):
        op(h, W[cols], t, logits_dtype="bfloat16")
    dist.barrier()
