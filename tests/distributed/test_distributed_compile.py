"""The vocab-parallel linear ops compile once for every token count (issue 27 item 3, the remainder).

Before, their chunk loops (``for s in range(0, n, rows)`` over the token count) were traced by Dynamo, which
needs a concrete ``n`` for the ``range``: under ``torch.compile(dynamic=True)`` each new count added a
compilation (measured on 2 gloo ranks, counts 9 / 14 / 23 / 35: ``vocab_parallel_linear_cross_entropy``
6, 7, 8, 9 compiled frames; ``vocab_parallel_linear_token_log_probs`` 8, 9, 10, 11). The collective-free
part of each pass is now one custom op (``distributed/chunk_ops.py``), the collectives outside it. The
probability-target ops did not compile at all (Dynamo's ``AssertionError: Placeholder node not found in
env``: their autograd Function returned one empty tensor for two outputs).

How it runs: as ``test_distributed.py`` (``dist_harness``: 2 gloo ranks, every rank runs every check with the
same seeded inputs). Each check compiles a forward+backward step (``aot_eager``, ``dynamic=True``; not
``fullgraph``: the set-up's ``all_gather`` and the collectives break the graph) and runs it on three token
counts, each a different number of chunks of 4 rows: the frame count must not grow after the second count
(one more for the 0/1 specialisation at most; the third count is the one that must reuse it), and every value
and gradient equals eager's.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fusedce.distributed as fd
from dist_harness import assert_passed, results

H, V, WORLD, CHUNK = 16, 96, 2, 4
COUNTS = (9, 14, 23)
CHECKS = {}


def _cross_entropy(h, Wr, t, cw, q):
    return fd.vocab_parallel_linear_cross_entropy(h, Wr, t, ce_weight_shard=cw, label_smoothing=0.1,
                                                  chunk_size=CHUNK)


def _soft(h, Wr, t, cw, q):
    return fd.vocab_parallel_linear_cross_entropy(h, Wr, q, ce_weight_shard=cw, chunk_size=CHUNK)


def _soft_logits(h, Wr, t, cw, q):   # no chunk loop; compiled at all (before: a Dynamo error, below)
    return fd.vocab_parallel_cross_entropy(h @ Wr.t(), q, weight_shard=cw)


def _log_probs(h, Wr, t, cw, q):
    out = fd.vocab_parallel_linear_token_log_probs(h, Wr, t, chunk_size=CHUNK, return_entropy=True)
    return out.log_probs.sum() + 0.1 * out.entropy.sum()


def _log_probs_k(h, Wr, t, cw, q):
    classes = torch.stack([t, (t + 1) % V, (t * 7) % V], dim=-1)
    return fd.vocab_parallel_linear_token_log_probs(h, Wr, classes, chunk_size=CHUNK).sum()


def _inputs(n: int, rank: int):
    g = torch.Generator().manual_seed(n)   # the same on every rank
    h = torch.randn(n, H, generator=g)
    W = torch.randn(V, H, generator=g) * 0.3
    t = torch.randint(0, V, (n,), generator=g)
    t[::5] = -100
    q = torch.softmax(torch.randn(n, V, generator=g), dim=-1)
    cw = torch.rand(V, generator=g) + 0.5
    part = slice(rank * V // WORLD, (rank + 1) * V // WORLD)
    return h, W[part].contiguous(), t, cw[part].contiguous(), q[:, part].contiguous()


def _step(fn, inputs):
    h, Wr, t, cw, q = inputs
    h, Wr = h.clone().requires_grad_(), Wr.clone().requires_grad_()
    loss = fn(h, Wr, t, cw, q)
    loss.backward()
    return loss.detach(), h.grad, Wr.grad


def _one_compilation(fn, rank):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, dynamic=True)
    frames = []
    for n in COUNTS:
        inputs = _inputs(n, rank)
        eager, traced = _step(fn, inputs), _step(compiled, inputs)
        for name, a, b in zip(("loss", "grad_hidden", "grad_weight_shard"), eager, traced):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} at {n} tokens: {m}")
        frames.append(counter.frame_count)
    assert frames[1] <= frames[0] + 1 and frames[-1] == frames[1], (
        f"compiled frames after each of the token counts {COUNTS}: {frames}: the graph specializes on the count")


for _name, _fn in {"cross_entropy": _cross_entropy, "probability_targets": _soft,
                   "probability_targets_logits": _soft_logits, "log_probs": _log_probs,
                   "log_probs_k": _log_probs_k}.items():
    CHECKS[_name] = lambda rank, world, fn=_fn: _one_compilation(fn, rank)


@pytest.mark.parametrize("name", list(CHECKS))
def test_vocab_parallel_linear_ops_compile_once(name, request, tmp_path_factory):
    """Every op on 2 gloo ranks, the torch backend."""
    assert_passed(results(__name__, CHECKS, WORLD, "torch", request, tmp_path_factory)[name], WORLD)
