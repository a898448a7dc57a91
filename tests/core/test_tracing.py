"""Tracing without data (issue 27, item 2): fake and meta tensors, ``make_fx`` (fake and symbolic modes),
``aot_function`` and non-strict ``torch.export`` trace every public tensor op on both backends (Triton under
the interpreter), and the replayed graph equals eager. Before, the target-range host check and the linear
ops' row compaction were skipped only under torch.compile / CUDA-graph capture, so every op died on a
data-dependent guard naming neither fusedce nor the cause; the Triton vocab-parallel slices were plain
launches (no custom op), which a fake tensor cannot run.

Inputs: ``public_ops.make_inputs`` (10 tokens, H = 12, V = 37); the vocab-parallel ops on a one-rank gloo
group. Replay vs eager: bitwise with no ignored rows. With ignored rows eager compacts the kept rows
before the LM head (``lm_head/head.py``, a host count a trace cannot make) and the graph computes
all rows, so the linear ops' matmuls see other row counts: there, torch's default fp32 closeness.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fusedce
from public_ops import CALLS, V, make_inputs, with_logits


def _skip_drop_in(name, backend):
    if name.startswith("fusedce.nn.") and backend != "torch":
        pytest.skip("torch's drop-in takes no backend (the default backend: torch on CPU)")


def _inputs(ignored: bool):
    x = make_inputs()
    if not ignored:
        x["target"][2], x["target"][7] = 3, V - 1
    x = with_logits(x)
    x = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
    keys = sorted(k for k, v in x.items() if isinstance(v, torch.Tensor))
    return keys, [x[k] for k in keys]


def _fn(name, backend, keys):
    _, call = CALLS[name]
    return lambda *vals: call(dict(zip(keys, vals)), backend)


def _same(got, want, bitwise):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if bitwise:
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
        else:
            torch.testing.assert_close(g, w, equal_nan=True)


@pytest.mark.parametrize("ignored", [False, True], ids=["all_rows", "ignored_rows"])
@pytest.mark.parametrize("mode", ["fake", "symbolic"])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_make_fx_traces_every_op_and_replays_as_eager(name, backend, mode, ignored, group):
    _skip_drop_in(name, backend)
    keys, vals = _inputs(ignored)
    f = _fn(name, backend, keys)
    graph = make_fx(f, tracing_mode=mode)(*vals)
    _same(graph(*vals), f(*vals), bitwise=not ignored)


@pytest.mark.parametrize("device", ["fake", "meta"])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_fake_and_meta_tensors_give_eager_shapes(name, backend, device, group):
    """FSDP2's meta-device initialisation and memory estimators call the op on tensors without data: the
    outputs have eager's shapes and dtypes."""
    _skip_drop_in(name, backend)
    keys, vals = _inputs(True)
    f = _fn(name, backend, keys)
    want = f(*vals)
    if device == "meta":
        got = f(*[v.to("meta") for v in vals])
        assert all(g.device.type == "meta" for g in got)
    else:
        with FakeTensorMode() as mode:
            got = f(*[mode.from_tensor(v) for v in vals])
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]


LINEAR = {
    "cross_entropy": lambda h, w, t, b: fusedce.cross_entropy(h @ w.t(), t, backend=b),
    "linear_cross_entropy_chunked": lambda h, w, t, b: fusedce.linear_cross_entropy(
        h, w, t, method="chunked", backend=b),
    "linear_cross_entropy_tiled": lambda h, w, t, b: fusedce.linear_cross_entropy(
        h, w, t, method="tiled", backend=b),
    "linear_token_log_probs_chunked": lambda h, w, t, b: fusedce.linear_token_log_probs(
        h, w, t, method="chunked", backend=b).sum(),
}


def _leaves():
    h, w = torch.randn(10, 12), torch.randn(V, 12) * 0.5
    t = torch.randint(0, V, (10,))
    return h, w, t


@pytest.mark.parametrize("case", sorted(LINEAR))
def test_aot_function_values_and_gradients_equal_eager(case, backend):
    from functorch.compile import aot_function, nop
    h, w, t = _leaves()
    fn = lambda a, b, c: LINEAR[case](a, b, c, backend)   # noqa: E731
    compiled = aot_function(fn, fw_compiler=nop, bw_compiler=nop)
    out = []
    for f in (compiled, fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = f(hh, ww, t)
        out.append((loss, *torch.autograd.grad(loss, (hh, ww))))
    for g, e in zip(*out):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("case", sorted(LINEAR))
def test_non_strict_export_replays_as_eager(case, backend):
    h, w, t = _leaves()

    class M(torch.nn.Module):
        def forward(self, a, b, c):
            return LINEAR[case](a, b, c, backend)

    program = torch.export.export(M(), (h, w, t), strict=False)
    torch.testing.assert_close(program.module()(h, w, t), M()(h, w, t), rtol=0, atol=0)
