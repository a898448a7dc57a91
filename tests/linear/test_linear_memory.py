"""What ``linear_cross_entropy`` allocates and computes, observed op by op with a TorchDispatchMode over
forward and backward:

- no BT x V tensor, ever: every tensor an op allocates holds at most one chunk of logits (``chunk_size x V``
  elements), for a given chunk size and for the automatic one (lm_head/head.py's rule);
- no gradient buffers under ``torch.no_grad()`` (nothing of the weight's V x H size), same loss;
- ignored tokens cost no matmul FLOPs: counted from every mm / addmm's operand shapes.
"""
import pytest
import torch

import fusedce
from fusedce.lm_head.loop import CPU_MIN_ROWS, MIN_ROWS, chunk_rows
from inputs import make_target
from op_recorder import OpRecorder
from reference64_linear import make_linear


def _fwd_bwd(hidden, weight, target, bias=None, *, backend, reduction="mean", **kw):
    """Forward + backward under the recorder (a per-token upstream for "none")."""
    rec = OpRecorder()
    with rec:
        out = fusedce.linear_cross_entropy(hidden, weight, target, bias, backend=backend, reduction=reduction, **kw)
        loss = out.loss if isinstance(out, fusedce.CrossEntropyOutput) else out
        if loss.requires_grad:
            loss.backward(torch.randn(loss.shape) if reduction == "none" else None)
    return rec, loss.detach()


# ---------------------------------------------------------------------------------------------------
# Explicit chunk size. torch: the shape BT=512, H=16, V=2000, chunk 64: BT x V = 1.02e6 elements
# is 8x one chunk of logits (1.28e5) and 32x the weight (3.2e4). triton (interpreter): BT=64, H=8,
# V=500, chunk 8: BT x V = 3.2e4 = 8 chunks of 4e3; the weight is 4e3.
SHAPES = {"torch": (512, 16, 2000, 64), "triton": (64, 8, 500, 8)}


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_bt_by_v_tensor(backend, reduction):
    bt, n_hidden, n_classes, chunk = SHAPES[backend]
    hidden, weight, bias = make_linear((bt,), n_hidden, n_classes, bias=True)
    target = make_target((bt,), n_classes, ignore_every=5)
    rec, _ = _fwd_bwd(hidden, weight, target, bias, backend=backend, reduction=reduction, chunk_size=chunk,
                      return_stats=True, label_smoothing=0.1, lse_square_scale=1e-2, softcap=30.0)
    assert rec.largest <= chunk * n_classes < bt * n_classes, (
        f"largest allocation {rec.largest} elements ({rec.largest_op}) > one chunk of logits "
        f"{chunk} x {n_classes}")
    assert hidden.grad is not None and weight.grad is not None and bias.grad is not None


@pytest.mark.parametrize("shape", [(3000, 8, 3000), (3000, 400, 1000)], ids=["min_rows", "h_over_4"])
def test_automatic_chunk_size_rule_cpu(shape):
    """chunk_size=None on CPU (torch backend): rows = min(BT, max(64, ceil(H / 4))), the documented rule,
    whatever BT and V: 64 rows for (3000, 8, 3000) (a chunk 1.9e5 < BT x V = 9e6); H / 4 = 100 rows for
    (3000, 400, 1000) (1e5 < 3e6)."""
    bt, n_hidden, n_classes = shape
    rows = min(bt, max(CPU_MIN_ROWS, -(-n_hidden // 4)))
    hidden, weight, _ = make_linear((bt,), n_hidden, n_classes)
    target = torch.randint(0, n_classes, (bt,))
    rec, _ = _fwd_bwd(hidden, weight, target, backend="torch", chunk_size=None)
    assert rec.largest <= max(rows * n_classes, bt * n_hidden, n_classes * n_hidden) < bt * n_classes, rec.largest_op
    assert rows * n_classes in rec.sizes, "the chunk's logits have the documented number of rows"


def test_automatic_chunk_size_rule_gpu():
    """On CUDA (and any device but the CPU): rows = min(BT, max(1024, ceil(BT H / V))): 1024 rows of 3000
    for (3000, 8, 3000); BT H / V = 1920 rows for (3000, 64, 100); BT itself when it is smaller."""
    assert chunk_rows(3000, 8, 3000, "cuda") == MIN_ROWS == 1024
    assert chunk_rows(3000, 64, 100, "cuda") == 1920
    assert chunk_rows(500, 64, 100, "cuda") == 500
    assert chunk_rows(3000, 8, 3000, "cpu") == 64 and chunk_rows(30, 8, 3000, "cpu") == 30


def test_no_gradient_buffers_under_no_grad(backend):
    """Forward under torch.no_grad(): nothing of the weight gradient's V x H size is allocated (V x H =
    1.5e4 > a chunk of logits 8 x 300 = 2.4e3 and the hidden states 32 x 48), no output carries a
    gradient, and the loss equals the one of the gradient-enabled call bit for bit."""
    bt, n_hidden, n_classes, chunk = 32, 48, 300, 8
    hidden, weight, bias = make_linear((bt,), n_hidden, n_classes, bias=True)
    target = make_target((bt,), n_classes, ignore_every=4)
    for reduction in ("mean", "none"):
        kw = dict(backend=backend, reduction=reduction, chunk_size=chunk, return_stats=True)
        rec = OpRecorder()
        with torch.no_grad(), rec:
            out = fusedce.linear_cross_entropy(hidden, weight, target, bias, **kw)
        assert rec.largest < n_classes * n_hidden, rec.largest_op
        assert all(t.grad_fn is None and not t.requires_grad for t in out)
        with_grad = fusedce.linear_cross_entropy(hidden, weight, target, bias, **kw)
        assert with_grad.loss.requires_grad
        assert torch.equal(out.loss, with_grad.loss.detach()), (reduction, out.loss, with_grad.loss)
        for field in ("lse", "predicted_tokens", "z_loss", "token_accuracy"):
            assert torch.equal(getattr(out, field), getattr(with_grad, field)), field
    rec_grad, _ = _fwd_bwd(hidden, weight, target, bias, backend=backend, chunk_size=chunk)
    assert rec_grad.largest >= n_classes * n_hidden, "premise: with gradients the V x H buffer shows"
    assert hidden.grad is not None


# ---------------------------------------------------------------------------------------------------
# Compaction: 32 tokens, H = 16, V = 300; FLOPs counted from the matmuls' shapes. Stock PyTorch does
# 3 matmuls of 2 BT V H (logits, grad_hidden, grad_weight); the fused mean / sum the same 3 on the
# non-ignored rows only; "none" one more (its backward recomputes the logits, documented).
FL_BT, FL_H, FL_V = 32, 16, 300


def _flops(backend, ignore_every, reduction, bias=False):
    hidden, weight, b = make_linear((FL_BT,), FL_H, FL_V, bias=bias)
    target = torch.randint(0, FL_V, (FL_BT,))
    if ignore_every:
        target[::ignore_every] = -100
    rec, _ = _fwd_bwd(hidden, weight, target, b, backend=backend, reduction=reduction, chunk_size=5)
    return rec.flops, int((target != -100).sum())


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_ignored_tokens_cost_no_flops(backend, reduction):
    full, n_full = _flops(backend, 0, reduction, bias=True)
    half, n_half = _flops(backend, 2, reduction, bias=True)
    assert n_half == n_full // 2 == FL_BT // 2
    assert half * 2 == full, f"50% ignored: {half} matmul FLOPs, {full} with none ignored"
    matmuls = 3 if reduction == "mean" else 4
    assert full == matmuls * 2 * FL_BT * FL_V * FL_H
    none_left, _ = _flops(backend, 1, reduction)
    assert none_left == 0, "every token ignored: no matmul at all"


def test_stock_flops_premise():
    """The FLOP counter sees stock PyTorch's 3 matmuls (so the counts above mean what they say)."""
    hidden, weight, _ = make_linear((FL_BT,), FL_H, FL_V)
    target = torch.randint(0, FL_V, (FL_BT,))
    rec = OpRecorder()
    with rec:
        torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight), target).backward()
    assert rec.flops == 3 * 2 * FL_BT * FL_V * FL_H


@pytest.mark.parametrize("frozen, matmuls", [("weight", 2), ("hidden", 2), ("both", 1)])
def test_frozen_tensors_skip_their_matmul(backend, frozen, matmuls):
    """A frozen weight costs no grad_W matmul, a frozen hidden no grad_hidden matmul (mean)."""
    hidden, weight, _ = make_linear((FL_BT,), FL_H, FL_V,
                                    requires_grad=(frozen == "weight", frozen == "hidden", False))
    target = torch.randint(0, FL_V, (FL_BT,))
    rec, _ = _fwd_bwd(hidden, weight, target, backend=backend, chunk_size=5)
    assert rec.flops == matmuls * 2 * FL_BT * FL_V * FL_H
