"""One compilation for every token count (issue 27 item 3).

Before, every chunk loop of the linear ops (``for s in range(0, n, rows)``) was traced by Dynamo, which needs
a concrete ``n`` for the ``range``: under ``torch.compile(dynamic=True)`` the chunked method (the default,
``method="auto"``) compiled once per distinct number of tokens (4 lengths: 4-5 compilations), and so did the
K-class log-probs, the chunked distillation and the probability targets (whose tiled loop took 14
compilations and 300 s for 4 lengths); with ``torch._dynamo.mark_dynamic`` it raised
``ConstraintViolationError``. Each loop is now one custom op (``lm_head/loop.py``, ``distill/chunk_op.py``,
``rl/kclass_ops.py``, ``lm_head/probs_loop.py``, ``backends/pytorch/custom_ops.py``), decided inside from the real
``n``.

Each case compiles a forward+backward step (``fullgraph=True``, ``dynamic=True``) and runs it on three token
counts, every one larger than any chunk, so that each takes a different number of chunks: at most one
compilation beyond the first (the 0/1 specialisation of a size Dynamo may meet; a graph specialized on the
count compiles three times), the values and gradients equal to eager's. ``aot_eager`` (Dynamo + AOTAutograd,
where the specialisation happened) keeps it fast; the default op also runs once with Inductor. The Triton
backend (under the interpreter) runs the default op.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fusedce

H, V, K = 16, 96, 3
CHUNK = 4                       # rows per chunk: 3 to 6 chunks over the counts below
COUNTS = (9, 14, 23)


def _lce(method, chunk, backend):
    def step(h, W, t, ht, Wt):
        return fusedce.linear_cross_entropy(h, W, t, method=method, chunk_size=chunk, backend=backend)
    return step


def _soft(method, chunk, backend):
    def step(h, W, t, ht, Wt):
        q = torch.softmax(ht @ Wt.t(), dim=-1)
        return fusedce.linear_cross_entropy(h, W, q, method=method, chunk_size=chunk, backend=backend)
    return step


def _log_probs(method, chunk, backend):
    def step(h, W, t, ht, Wt):
        out = fusedce.linear_token_log_probs(h, W, t, method=method, chunk_size=chunk, backend=backend,
                                             return_entropy=True)
        return out.log_probs.sum() + 0.1 * out.entropy.sum()
    return step


def _log_probs_k(method, chunk, backend):
    def step(h, W, t, ht, Wt):
        classes = torch.stack([t, (t + 1) % V, (t * 7) % V], dim=-1)
        return fusedce.linear_token_log_probs(h, W, classes, method=method, chunk_size=chunk,
                                              backend=backend).sum()
    return step


def _distill(method, chunk, backend):
    def step(h, W, t, ht, Wt):
        return fusedce.linear_distillation_loss(h, W, ht, Wt, target=t, method=method, chunk_size=chunk,
                                                backend=backend)
    return step


def _topk(method, chunk, backend):
    def step(h, W, t, ht, Wt):
        lp, ids = torch.log_softmax(ht @ Wt.t(), dim=-1).topk(K, dim=-1)
        return fusedce.linear_topk_distillation_loss(h, W, ids, lp, target=t, method=method, chunk_size=chunk,
                                                     backend=backend)
    return step


OPS = {"linear_cross_entropy": _lce, "probability_targets": _soft, "log_probs": _log_probs,
       "log_probs_k": _log_probs_k, "distillation": _distill, "topk_distillation": _topk}


def _inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g).requires_grad_()
    W = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    t = torch.randint(0, V, (n,), generator=g)
    t[::5] = -100   # some ignored rows (no compaction under compile: the kernels skip them)
    ht = torch.randn(n, H, generator=g)
    Wt = torch.randn(V, H, generator=g) * 0.3
    return h, W, t, ht, Wt


def _run(step, compiled, n: int):
    h, W, t, ht, Wt = _inputs(n, n)
    loss = step(h, W, t, ht, Wt)
    loss.backward()
    out = [loss.detach(), h.grad, W.grad]
    if compiled is None:
        return out
    h2, W2 = h.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    loss2 = compiled(h2, W2, t, ht, Wt)
    loss2.backward()
    return out, [loss2.detach(), h2.grad, W2.grad]


def _check(make, method, chunk, backend, compiler: str = "aot_eager"):
    torch._dynamo.reset()
    step = make(method, chunk, backend)
    counter = CompileCounterWithBackend(compiler)
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for n in COUNTS:
        eager, traced = _run(step, compiled, n)
        for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), eager, traced):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} at {n} tokens: {m}")
    assert counter.frame_count <= 2, (
        f"{counter.frame_count} compilations for {len(COUNTS)} token counts: the graph specializes on the count")


@pytest.mark.parametrize("method", ["chunked", "tiled"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_one_compilation_for_every_token_count(op, method):
    _check(OPS[op], method, CHUNK if method == "chunked" else None, "torch")


def test_the_default_method_and_chunk_rule_compile_once_with_inductor():
    """``method="auto"`` and ``chunk_size=None`` (the rule, decided from the real count inside the op)."""
    _check(_lce, "auto", None, "torch", compiler="inductor")


def test_the_triton_backend_compiles_once():
    _check(_lce, "chunked", CHUNK, "triton")


def test_mark_dynamic_takes_the_token_dimension():
    """``mark_dynamic`` on the token dimension: no ``ConstraintViolationError`` (the count stays symbolic
    through the op), one compilation for two counts."""
    torch._dynamo.reset()
    step = _lce("chunked", CHUNK, "torch")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for n in COUNTS[:2]:
        h, W, t, ht, Wt = _inputs(n, n)
        torch._dynamo.mark_dynamic(h, 0)
        torch._dynamo.mark_dynamic(t, 0)
        compiled(h, W, t, ht, Wt).backward()
    assert counter.frame_count == 1


@pytest.mark.parametrize("op", ["linear_cross_entropy", "log_probs", "distillation", "linear_cross_entropy_tiled",
                                "log_probs_tiled"])
def test_batch_invariant_compiles_once_with_and_without_padding(op):
    """``batch_invariant=True`` pads the rows to a multiple of 64 (the tiled method: of its token tile): under
    compile the padding is always applied (``F.pad``, possibly 0 rows), so a count that needs none (64, 128)
    does not specialize the graph (before: ``if pad == 0`` and ``torch.cat``'s empty-tensor test each added a
    guard)."""
    calls = {
        "linear_cross_entropy_tiled": lambda h, W, t, ht, Wt: fusedce.linear_cross_entropy(
            h, W, t, backend="torch", method="tiled", batch_invariant=True),
        "log_probs_tiled": lambda h, W, t, ht, Wt: fusedce.linear_token_log_probs(
            h, W, t, backend="torch", method="tiled", batch_invariant=True).sum(),
        "linear_cross_entropy": lambda h, W, t, ht, Wt: fusedce.linear_cross_entropy(
            h, W, t, backend="torch", batch_invariant=True),
        "log_probs": lambda h, W, t, ht, Wt: fusedce.linear_token_log_probs(
            h, W, t, backend="torch", batch_invariant=True).sum(),
        "distillation": lambda h, W, t, ht, Wt: fusedce.linear_distillation_loss(
            h, W, ht, Wt, target=t, backend="torch", batch_invariant=True),
    }
    torch._dynamo.reset()
    step = calls[op]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for n in (37, 64, 100, 128):
        eager, traced = _run(step, compiled, n)
        for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), eager, traced):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} at {n} tokens: {m}")
    assert counter.frame_count <= 2, counter.frame_count
