"""backend="cute" launches are torch custom ops (``fusedce_cute::*``, backends/cute/custom_ops.py) with
fake implementations, so ``torch.compile(fullgraph=True)`` traces them. Without a GPU only the fake /
meta path can run: "meta" tensors (shapes and dtypes, no data) go through the ops, their autograd
formula and a fullgraph compile (``aot_eager``: it runs the traced graph, here on meta tensors, so no
kernel is launched and ``cutlass`` is never imported). Shapes: 6 rows x 10 classes, bf16 (the logits
dtype must survive into the gradient)."""
import subprocess
import sys

import pytest
import torch

from fusedce.backends.cute import custom_ops, linear, cross_entropy as ops  # noqa: F401 - registers the ops
from fusedce.core.options import LossOptions

OPTS = LossOptions(label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0, use_token_scaling=True)


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_cute_ops_are_registered_with_fakes():
    x, t = _meta(6, 10, dtype=torch.bfloat16), _meta(6, dtype=torch.int64)
    args = (x, t, None, None, *OPTS.op_args(), True, False)
    torch.library.opcheck(torch.ops.fusedce_cute.ce_forward.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    loss, lse, lse_lo, pred = torch.ops.fusedce_cute.ce_forward(*args)
    assert [a.shape for a in (loss, lse, lse_lo, pred)] == [(6,)] * 4 and pred.dtype == torch.int64
    grad = torch.ops.fusedce_cute.ce_backward(x, t, None, None, lse, lse_lo, _meta(6), None, *OPTS.op_args())
    assert grad.shape == x.shape and grad.dtype == torch.bfloat16
    out = torch.ops.fusedce_cute.ce_chunk_(x.clone(), t, None, None, _meta(6), _meta(6), *OPTS.op_args(), False)
    assert [tuple(a.shape) for a in out] == [(6,), (6,), (6,), (0,), (6,)]   # no stats; token weights
    w = _meta(10)
    assert torch.ops.fusedce_cute.ce_backward_inplace(x.clone(), t, w, _meta(1), lse, lse_lo, _meta(6), _meta(6),
                                                      *OPTS.op_args()) is None


@pytest.mark.parametrize("inplace", [False, True])
def test_cute_rows_trace_fullgraph(inplace):
    """``ops.cross_entropy_rows`` forward and backward under ``torch.compile(fullgraph=True)``: a graph
    break would raise. The gradient keeps the logits' shape and dtype."""
    x = _meta(6, 10, dtype=torch.bfloat16).requires_grad_(True)
    t = _meta(6, dtype=torch.int64)

    def f(x, t):
        loss, lse, _lo, _pred = ops.cross_entropy_rows(x * 1, t, _meta(10), OPTS, inplace, True)
        return (loss + OPTS.lse_square_scale * lse * lse).sum()

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, t)
    out.backward()
    assert out.shape == () and x.grad.shape == x.shape and x.grad.dtype == torch.bfloat16


def test_cute_chunk_ce_traces_fullgraph():
    """The linear chunk loop's per-chunk calls (``CuteChunkCE``) are custom ops too."""
    x, t = _meta(6, 10, dtype=torch.bfloat16), _meta(6, dtype=torch.int64)

    def f(x, t):
        loss, lse, lse_lo, pred, tw = linear.CuteChunkCE.loss_and_grad_(x, t, None, None, _meta(6), _meta(6), OPTS,
                                                                        True)
        linear.CuteChunkCE.grad_(x, t, None, None, lse, lse_lo, _meta(6), None, OPTS)
        return loss.sum() + tw.sum(), pred

    torch._dynamo.reset()
    total, pred = torch.compile(f, fullgraph=True, backend="aot_eager")(x.clone(), t)
    assert total.shape == () and pred.shape == (6,)


def test_registering_the_ops_does_not_import_cutlass():
    code = ("import sys, fusedce.backends.cute.cross_entropy, fusedce.backends.cute.linear; "
            "sys.exit(1 if 'cutlass' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
