"""torch.compile of the PyTorch backend's loops costs the same whatever V and the block sizes are.

Every loop of the torch backend (row chunks of ``cross_entropy`` and the RL ops, the chunks and the
tiled method's token x vocabulary blocks of the linear ops, the vocab-parallel slices) is one custom op
(``backends/pytorch/custom_ops.py``); before, Dynamo unrolled it: the tiled linear loss at 64 tokens, H
= 256, V = 32256 traced 2925 forward and 5300 backward nodes and took 349 s to compile with Inductor.

Each case compiles a forward+backward step with Dynamo + AOTAutograd (``aot_eager``: tracing, where the
unrolling happens, without Inductor's codegen, whose time grows with the nodes traced) and checks
1. the forward and backward graphs have as many nodes at V = 32256 (DeepSeek-Coder's vocabulary; 1024
   classes a tiled block, 31 rows) as at V = 4096 (a different number of blocks and row chunks): the
   graph does not grow with V nor with the block count;
2. the first compiled call (tracing + run) takes at most ``COMPILE_OVER_EAGER`` times the eager call at
   V = 32256 (before: 25x for the tiled loss, 11x for chunked; after: 1-3x on the 2-core dev machine);
3. the compiled values and gradients equal eager's.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import fusedce
import fusedce.distributed as fd

V_SMALL, V_REAL = 4096, 32256
# (tokens, H): the ops on logits and the chunked linear ops take 600 tokens, more than one row chunk
# of 2**24 elements at V_REAL (520 rows: 2 chunks; 1 at V_SMALL), at H = 128, so that the eager call
# (0.2-0.5 s on the 2-core dev VM) is long against Dynamo's fixed cost; the tiled ops 192 tokens x H =
# 256 (the H; 224 blocks of 31 x 1024 at V_REAL, 4 vocabulary blocks a row block at V_SMALL).
ROWS, TILED = (600, 128), (192, 256)
# the vocab-parallel ops graph-break at the layout exchange: several graphs, each with Dynamo's fixed
# cost, so their eager call is made 4x longer (more tokens) for the ratio to measure growth, not that cost
VP_ROWS = (2400, 128)
COMPILE_OVER_EAGER = 8.0


def _linear(method, **kw):
    return lambda h, W, t: fusedce.linear_cross_entropy(h, W, t, method=method, backend="torch", **kw)


def _rl(method):
    def step(h, W, t):
        out = fusedce.linear_token_log_probs(h, W, t, method=method, backend="torch", return_entropy=True)
        return out.log_probs.sum() + 0.1 * out.entropy.sum()
    return step


def _rl_logits(h, W, t):
    out = fusedce.token_log_probs(h @ W.t(), t, backend="torch", return_entropy=True)
    return out.log_probs.sum() + 0.1 * out.entropy.sum()


CASES = {   # name -> (step, shape, fullgraph)
    "cross_entropy": (lambda h, W, t: fusedce.cross_entropy(h @ W.t(), t, label_smoothing=0.1, backend="torch"),
                      ROWS, True),
    "linear-chunked": (_linear("chunked", lse_square_scale=1e-3), ROWS, True),
    "linear-tiled": (_linear("tiled", label_smoothing=0.1), TILED, True),
    "rl-logits": (_rl_logits, ROWS, True),
    "rl-chunked": (_rl("chunked"), ROWS, True),
    "rl-tiled": (_rl("tiled"), TILED, True),
    # the vocab-parallel ops graph-break at the layout exchange (all_gather_object), never inside a loop
    "vocab-parallel": (lambda h, W, t: fd.vocab_parallel_cross_entropy(h @ W.t(), t, backend="torch"), VP_ROWS,
                       False),
    "vocab-parallel-linear": (lambda h, W, t: fd.vocab_parallel_linear_cross_entropy(h, W, t, backend="torch"),
                              VP_ROWS, False),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def _group(tmp_path_factory):
    """A world-size-1 gloo group for the vocab-parallel cases (the whole vocabulary on rank 0)."""
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _inputs(n_classes, shape):
    n_rows, hidden_size = shape
    hidden = torch.randn(n_rows, hidden_size, requires_grad=True)
    weight = (torch.randn(n_classes, hidden_size) * hidden_size ** -0.5).requires_grad_()
    target = torch.randint(0, n_classes, (n_rows,))
    target[::7] = -100
    return hidden, weight, target


def _step(fn, hidden, weight, target):
    """One forward + backward: ``(output, grad of hidden, grad of weight)``."""
    hidden.grad = weight.grad = None
    out = fn(hidden, weight, target)
    out.backward()
    return out.detach(), hidden.grad, weight.grad


def _compiled(fn, counts, fullgraph):
    def compiler(gm, _example_inputs):
        counts.append(len(gm.graph.nodes))
        return make_boxed_func(gm.forward)
    return torch.compile(fn, backend=aot_autograd(fw_compiler=compiler, bw_compiler=compiler), fullgraph=fullgraph)


@pytest.mark.parametrize("case", list(CASES))
def test_compile_does_not_grow_with_vocabulary(case, request):
    if case.startswith("vocab-parallel"):
        request.getfixturevalue("_group")
    fn, shape, fullgraph = CASES[case]
    counts = {V_SMALL: [], V_REAL: []}
    _step(_compiled(fn, counts[V_SMALL], fullgraph), *_inputs(V_SMALL, shape))
    torch._dynamo.reset()
    inputs = _inputs(V_REAL, shape)
    _step(fn, *inputs)                                       # warm-up: first-call costs out of the timing
    start = time.perf_counter()
    eager = _step(fn, *inputs)
    eager_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = _step(_compiled(fn, counts[V_REAL], fullgraph), *inputs)
    compile_s = time.perf_counter() - start
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if fullgraph:
        assert len(counts[V_REAL]) == 2, counts              # one forward and one backward graph
    assert counts[V_REAL] == counts[V_SMALL], counts
    print(f"{case}: compile + first call {compile_s:.2f} s, eager call {eager_s:.2f} s")
    assert compile_s <= COMPILE_OVER_EAGER * eager_s, (compile_s, eager_s)


def test_torch_loop_ops_opcheck():
    """``torch.library.opcheck`` of every ``fusedce_torch`` op (schema, declared mutations, fake impls,
    AOT dispatch) with the strides Inductor may hand over: logits with a row stride > V, an expanded
    stride-0 upstream gradient, a stride-2 one."""
    from fusedce.backends.pytorch import custom_ops  # noqa: F401  (registers the ops)
    from fusedce.core.options import LossOptions

    n_rows, n_classes, hidden_size = 6, 40, 8
    logits = torch.randn(n_rows, n_classes + 8)[:, :n_classes]
    target = torch.randint(0, n_classes, (n_rows,))
    target[1] = -100
    w = torch.rand(n_classes) + 0.5
    weight_sum = w.sum()
    lse, lse_lo = torch.logsumexp(logits, dim=1), torch.zeros(n_rows)
    grad_row = torch.randn(1).expand(n_rows)
    grad_lse = torch.randn(n_rows * 2)[::2]
    hidden, weight, bias = torch.randn(n_rows, hidden_size), torch.randn(n_classes, hidden_size), torch.randn(n_classes)
    smooth = LossOptions(-100, 0.1, 1e-3, 30.0).op_args()
    plain = LossOptions(-100).op_args()
    ops = torch.ops.fusedce_torch
    checks = [
        (ops.chunk_loss.default, (logits, target, w, weight_sum, *smooth, True, True)),
        (ops.chunk_loss.default, (logits, target, None, None, *plain, False, False)),
        (ops.chunk_grad_inplace.default, (logits.clone(), target, w, weight_sum, lse, lse_lo, grad_row, grad_lse,
                                          *smooth)),
        (ops.chunk_grad_out.default, (logits, torch.empty(n_rows, n_classes), target, None, None, lse, lse_lo,
                                      grad_row, None, *plain, grad_lse, lse)),
        (ops.tiled_forward.default, (hidden, weight, bias, target, w, weight_sum, *smooth, True, True, False, False)),
        (ops.tiled_forward.default, (hidden, weight, None, target, None, None, *plain, False, False, True, True)),
        (ops.chunk_token_stats.default, (logits, target, lse, lse_lo, *smooth)),
        (ops.tiled_backward.default, (hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse,
                                      *smooth, True, True, True, torch.float32, grad_lse, lse, False)),
        (ops.tiled_backward.default, (hidden, weight, None, target, None, None, lse, lse_lo, grad_row, None,
                                      *plain, True, False, False, torch.float64, None, None, True)),
        (ops.slice_stats.default, (logits, target, w, *smooth, 100, False)),
        (ops.slice_stats.default, (logits, target, None, *plain, 100, True)),
        (ops.slice_grad.default, (logits, target, w, weight_sum, None, lse, lse_lo, grad_row, grad_lse, *smooth,
                                  0, n_classes, None, None)),
        (ops.slice_grad.default, (logits, target, None, None, None, lse, lse_lo, grad_row, None, *plain,
                                  0, n_classes, grad_lse, lse)),
    ]
    for op, args in checks:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)
