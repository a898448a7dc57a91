"""torch.compile(fullgraph=True) traces through fusedce: no graph break, same numbers as eager.

The Triton launches are torch custom ops (``backends/triton/custom_ops.py``) with fake impls and an
autograd formula; the torch backend is a chunked ``autograd.Function`` that Dynamo traces. Each test
compiles a small training step, ``Linear(H -> V)`` then ``fusedce.cross_entropy``, runs backward outside
the compiled region (the usual training loop: AOTAutograd compiles the backward graph too) and compares
loss, stats and every gradient with the same step run eagerly. Eager itself is checked against the
float64 reference by the ``test_ce_*`` suites, so equality with eager is the whole claim here.

Compiling costs seconds per case on 2 CPU cores, so the option table is small and chosen to cover every
reduction and every option at least once (each row says what it adds), for both backends.
"""
import pytest
import torch
import torch._dynamo  # noqa: F401  (at collection time: see the note below)

import fusedce
from versions import TORCH

# Dynamo must be imported before any test patches torch.empty (inputs.poisoned_allocations does): its
# tables of traceable torch functions are built from the objects present at import time, and the first
# eager call of a torch custom op (the Triton backend) imports torch._dynamo lazily. Imported inside
# such a patch, Dynamo later sees the real torch.empty as an unknown builtin and graph-breaks on it.
# pytest imports every test module before running any test, so importing it here is early enough.

# Shapes: B, T = 3, 5 (3-D logits, flattened by the function); H = 16; V = 67 (odd: masked tails, no
# power-of-two luck). Two targets ignored, one of them the first row.
B, T, H, V = 3, 5, 16, 67
IGNORE = -100

# name -> (reduction, options). "weight" / "num_items" are built in _inputs.
CASES = {
    "mean": ("mean", {}),                                                    # plain; stride-0 upstream grad
    "sum-smoothing-weight": ("sum", {"label_smoothing": 0.1, "weight": True}),
    "none-zloss-softcap": ("none", {"lse_square_scale": 1e-2, "softcap": 5.0}),   # per-token upstream grad
    "mean-all-stats-num_items": ("mean", {"label_smoothing": 0.2, "lse_square_scale": 1e-3, "softcap": 8.0,
                                          "weight": True, "return_stats": True, "num_items": True}),
    "mean-inplace_backward": ("mean", {"inplace_backward": True, "label_smoothing": 0.1}),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles its own closures; reset so no case runs into Dynamo's recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs():
    model = torch.nn.Linear(H, V)
    x = torch.randn(B, T, H, requires_grad=True)
    target = torch.randint(0, V, (B, T))
    target[0, 0] = target[1, 3] = IGNORE
    return model, x, target


def _loss_fn(model, backend, reduction, options):
    kwargs = {k: v for k, v in options.items() if k not in ("weight", "num_items")}
    weight = torch.rand(V) + 0.5 if options.get("weight") else None

    def step(x, target, num_items):
        return fusedce.cross_entropy(model(x), target, weight, reduction=reduction, backend=backend,
                                     num_items_in_batch=num_items, **kwargs)
    return step


def _run(step, model, x, target, num_items, upstream):
    """Forward (maybe compiled), backward eagerly; returns outputs and the gradients of x, W, b."""
    model.zero_grad()
    x.grad = None
    out = step(x, target, num_items)
    loss = out.loss if isinstance(out, fusedce.CrossEntropyOutput) else out
    (loss * upstream).sum().backward() if loss.dim() else loss.backward()
    outs = tuple(t.detach() for t in out) if isinstance(out, tuple) else (loss.detach(),)
    return outs, (x.grad.clone(), model.weight.grad.clone(), model.bias.grad.clone())


@pytest.mark.parametrize("case", list(CASES))
def test_training_step_compiled_equals_eager(backend, case):
    reduction, options = CASES[case]
    model, x, target = _inputs()
    num_items = torch.tensor(11.0) if options.get("num_items") else None
    upstream = torch.randn(B, T)                      # exact per-token upstream gradient for "none"
    step = _loss_fn(model, backend, reduction, options)

    eager_out, eager_grads = _run(step, model, x, target, num_items, upstream)
    compiled_out, compiled_grads = _run(torch.compile(step, fullgraph=True), model, x, target, num_items,
                                        upstream)
    assert len(compiled_out) == len(eager_out)
    for got, want in zip(compiled_out + compiled_grads, eager_out + eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(TORCH < (2, 13), reason=f"torch {torch.__version__}'s AOTAutograd refuses the in-place gradient "
                    "write into the leaf logits while tracing the joint graph ('a leaf Variable that requires grad "
                    "is being used in an in-place operation'); torch 2.13 traces it")
def test_inplace_backward_writes_logits_storage_compiled(backend):
    """``inplace_backward=True`` under torch.compile: the gradient still lands in the logits' storage
    (the Triton backend's mutating custom op, re-inplaced by Inductor; the torch backend's chunk
    writes), and equals the out-of-place gradient."""
    logits = torch.randn(B * T, V, requires_grad=True)
    target = torch.randint(0, V, (B * T,))
    target[3] = IGNORE
    (expected,) = torch.autograd.grad(fusedce.cross_entropy(logits, target, backend=backend), logits)
    step = torch.compile(lambda z, t: fusedce.cross_entropy(z, t, inplace_backward=True, backend=backend),
                         fullgraph=True)
    step(logits, target).backward()
    torch.testing.assert_close(logits.grad, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(logits.detach(), expected, rtol=1e-5, atol=1e-7)


def test_no_graph_break(backend):
    """``torch._dynamo.explain`` over the option-heaviest case: one graph, zero breaks."""
    reduction, options = CASES["mean-all-stats-num_items"]
    model, x, target = _inputs()
    explanation = torch._dynamo.explain(_loss_fn(model, backend, reduction, options))(
        x, target, torch.tensor(11.0))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_dynamic_batch_size(backend):
    """Varying BT under ``dynamic=True`` (sequence packing changes it every step): fake impls are
    shape-generic, so one compiled graph serves every size."""
    model = torch.nn.Linear(H, V)
    step = torch.compile(lambda x, t: fusedce.cross_entropy(model(x), t, backend=backend),
                         fullgraph=True, dynamic=True)
    for n_rows in (7, 13):
        x, target = torch.randn(n_rows, H), torch.randint(0, V, (n_rows,))
        expected = torch.nn.functional.cross_entropy(model(x).double(), target).float()
        torch.testing.assert_close(step(x, target), expected, rtol=1e-5, atol=1e-6)


def test_c12_softcap_bf16_compiled(backend):
    """C12: softcap=30.0 on bf16 logits under torch.compile equals the float64 reference of
    30*tanh(x/30): the scalar stays a fp32 kernel argument (no fp64 promotion, no recompile per value).
    (16, 32000): a real vocabulary width with few rows, since the Triton interpreter is slow on CPU."""
    logits = (torch.randn(16, 32000) * 8).bfloat16().requires_grad_()
    target = torch.randint(0, 32000, (16,))
    step = torch.compile(lambda z, t: fusedce.cross_entropy(z, t, softcap=30.0, reduction="sum",
                                                            backend=backend), fullgraph=True)
    loss = step(logits, target)
    loss.backward()

    ref_logits = logits.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(30.0 * torch.tanh(ref_logits / 30.0), target, reduction="sum")
    ref.backward()
    assert loss.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=0.0)
    # The gradient is stored in bf16: one bf16 ulp (2^-7 relative) covers the rounding of the output
    # plus the fp32 arithmetic; the absolute floor is far below any element that matters.
    ref_grad = ref_logits.grad
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=2.0 ** -7,
                               atol=1e-6 * ref_grad.abs().max().item())


def test_custom_ops_opcheck():
    """``torch.library.opcheck``: schema (incl. the declared mutation), fake impls, autograd
    registration and AOT dispatch of each op, with the awkward strides Inductor may hand over
    (a row stride > V, an expanded stride-0 upstream gradient)."""
    from fusedce.backends.triton import custom_ops  # noqa: F401  (registers the ops)

    n_rows, n_cols = 6, 40
    storage = torch.randn(n_rows, n_cols + 8)
    logits = storage[:, :n_cols].requires_grad_()    # row stride 48 != V
    target = torch.randint(0, n_cols, (n_rows,))
    target[1] = IGNORE
    weight = torch.rand(n_cols) + 0.5
    weight_sum = weight.sum().reshape(1)
    lse = torch.logsumexp(logits.detach(), dim=1)
    lse_lo = torch.zeros(n_rows)
    grad_row = torch.randn(1).expand(n_rows)          # stride 0, as the gradient of loss.sum()
    grad_lse = torch.randn(n_rows * 2)[::2]            # stride 2: the z-loss's upstream through lse
    from fusedce.core.options import LossOptions
    softcap_opts = LossOptions(IGNORE, 0.1, 1e-3, 30.0).op_args()
    plain_opts = LossOptions(IGNORE).op_args()
    dft_opts = LossOptions(IGNORE, 0.0, 1e-3, None, 0.5, True).op_args()
    ops = torch.ops.fusedce
    checks = [
        (ops.ce_forward.default, (logits, target, None, None, *softcap_opts, True, False)),
        (ops.ce_forward.default, (logits, target, weight, weight_sum, *plain_opts, False, True)),
        (ops.ce_backward.default, (logits.detach(), target, weight, weight_sum, lse, lse_lo, grad_row,
                                   grad_lse, *softcap_opts)),
        (ops.ce_backward_inplace.default, (logits.detach().clone(), target, None, None, lse, lse_lo, grad_row,
                                           None, *plain_opts)),
        (ops.ce_chunk_.default, (logits.detach().clone(), target, weight, weight_sum, grad_row, grad_lse,
                                 *softcap_opts, True)),
        (ops.ce_chunk_.default, (logits.detach().clone(), target, None, None, grad_row, grad_row,
                                 *dft_opts, False)),
    ]
    for op, args in checks:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


# ---------------------------------------------------------------- linear_cross_entropy
# Same treatment: no graph break, compiled == eager. The Triton chunk CE (backends/triton/linear.py)
# goes through the custom ops, so Dynamo never traces into a kernel launch.
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_compiled_equals_eager(backend, reduction):
    hidden = torch.randn(B, T, H, requires_grad=True)
    head = torch.randn(V, H, requires_grad=True)
    target = torch.randint(0, V, (B, T))
    target[0, 0] = IGNORE
    upstream = torch.randn(B, T)

    def step(h, w, t):
        return fusedce.linear_cross_entropy(h, w, t, reduction=reduction, label_smoothing=0.1,
                                            softcap=8.0, backend=backend)

    def run(fn):
        hidden.grad = head.grad = None
        loss = fn(hidden, head, target)
        (loss * upstream).sum().backward() if loss.dim() else loss.backward()
        return loss.detach(), hidden.grad.clone(), head.grad.clone()

    explanation = torch._dynamo.explain(step)(hidden, head, target)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    for got, want in zip(run(torch.compile(step, fullgraph=True)), run(step)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- tiled method and the RL log-probs
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("what", ["tiled-mean", "log-probs-chunked", "log-probs-tiled", "log-probs-logits"])
def test_tiled_and_log_probs_compiled_equal_eager(backend, what):
    hidden = torch.randn(B, T, H, requires_grad=True)
    head = torch.randn(V, H, requires_grad=True)
    target = torch.randint(0, V, (B, T))
    target[0, 0] = IGNORE
    adv, bonus = torch.randn(B, T), torch.rand(B, T)

    def step(h, w, t):
        if what == "tiled-mean":
            return fusedce.linear_cross_entropy(h, w, t, label_smoothing=0.1, softcap=8.0, method="tiled",
                                                backend=backend)
        if what == "log-probs-logits":
            out = fusedce.token_log_probs(h @ w.t(), t, temperature=0.7, return_entropy=True, backend=backend)
        else:
            out = fusedce.linear_token_log_probs(h, w, t, temperature=0.7, softcap=8.0, return_entropy=True,
                                                 method=what.split("-")[-1], backend=backend)
        return (adv * out.log_probs).sum() + (bonus * out.entropy).sum()

    def run(fn):
        hidden.grad = head.grad = None
        loss = fn(hidden, head, target)
        loss.backward()
        return loss.detach(), hidden.grad.clone(), head.grad.clone()

    explanation = torch._dynamo.explain(step)(hidden, head, target)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    for got, want in zip(run(torch.compile(step, fullgraph=True)), run(step)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
