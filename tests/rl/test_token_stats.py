"""RL ops: ``logit_scale`` and TRL's per-token statistics (``return_stats=True``: ``log_sum_sq_probs``,
``mean_logits``, ``is_top1``, ``fusedce.TokenStats``) against float64, both backends, the logits form
and both linear methods, fp32 and bf16, with temperature, softcap and logit scale.

Inputs: V = 300 classes over several tiles (the torch tiles are shrunk to 64 classes x 4 rows, the
chunked method uses chunks of 5 rows), every 3rd row ignored, a few targets set to the row's argmax (so
``is_top1`` has hits to get right) and one row with the maximum tied between an earlier class and the
target, and between the target and a later class (the first index wins, as TRL's kernel and
``torch.argmax`` define it). The logits are built exactly representable in bf16 so the ties survive.
"""
import pytest
import torch

import fusedce
from fusedce.backends.pytorch import tuning as torch_tuning
from fusedce.backends.pytorch.linear import TorchChunkCE
from inputs import make_target
from reference64_log_probs import reference_log_probs, transformed_logits

V = 300
# (temperature, softcap, logit_scale)
SETTINGS = {"plain": (1.0, None, 1.0), "t0.7_scale2": (0.7, None, 2.0), "t1.3_cap5_scale0.5": (1.3, 5.0, 0.5)}
STATS = ("log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.fixture(autouse=True)
def tiny_tiles(monkeypatch):
    monkeypatch.setattr(torch_tuning, "TILE_ROWS", 4)
    monkeypatch.setattr(torch_tuning, "TILE_VOCAB", 64)


def _logits(rows: int) -> tuple:
    """(logits (rows, V) fp32 with bf16-exact values, target (rows,)); see the module docstring."""
    x = (torch.randn(rows, V) * 3).to(torch.bfloat16).float()
    target = make_target((rows,), V, ignore_every=3)
    target[3] = int(x[3].argmax())                          # hits
    target[5] = int(x[5].argmax())
    x[4, 70], x[4, 200] = 40.0, 40.0                         # tie: target at the later class -> miss
    target[4] = 200
    x[6, 10], x[6, 250] = 40.0, 40.0                         # tie: target at the earlier class -> hit
    target[6] = 10
    return x, target


def _reference(x64, target, temperature, softcap, scale):
    """float64 TokenStats fields, 0 / False on ignored rows: the log-probs and entropy from the RL ops' one
    reference (reference64_log_probs), the statistics from their formulas."""
    q = transformed_logits(x64, temperature, softcap, scale)
    valid = target != -100
    log_probs, entropy = reference_log_probs(x64, target, temperature, softcap, logit_scale=scale)
    out = {"log_probs": log_probs, "entropy": entropy,
           "log_sum_sq_probs": torch.logsumexp(2 * q, -1) - 2 * torch.logsumexp(q, -1), "mean_logits": q.mean(-1),
           "is_top1": q.argmax(-1) == target}
    return {k: v & valid if v.dtype == torch.bool else torch.where(valid, v, 0.0) for k, v in out.items()}


def _check(out, ref, atol):
    for name, expected in ref.items():
        got = getattr(out, name)
        assert got is not None and got.shape == expected.shape, name
        if expected.dtype == torch.bool:
            assert got.dtype == torch.bool and torch.equal(got, expected), name
        else:
            assert got.dtype == torch.float32 and not got.requires_grad or name in ("log_probs", "entropy")
            err = (got.detach().double() - expected).abs().max().item()
            assert err <= atol * (1 + expected.abs().max().item()), f"{name}: {err:.3g}"


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_token_log_probs_stats(backend, setting):
    temperature, softcap, scale = SETTINGS[setting]
    x, target = _logits(9)
    poisoned = x.clone().requires_grad_()
    out = fusedce.token_log_probs(poisoned, target, temperature=temperature, softcap=softcap, logit_scale=scale,
                                  return_entropy=True, return_stats=True, backend=backend)
    assert isinstance(out, fusedce.TokenStats)
    ref = _reference(x.double(), target, temperature, softcap, scale)
    _check(out, ref, 2e-6)
    assert bool(out.is_top1[3]) and bool(out.is_top1[6]) and not bool(out.is_top1[4])
    assert not any(getattr(out, name).requires_grad for name in STATS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["chunked", "tiled"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_linear_token_log_probs_stats_and_gradients(backend, setting, method, dtype):
    """The statistics against float64 of the exact logits (the linear ops form fp32 logits from the
    inputs' values, never rounded to their dtype); the log-probs and entropy and
    their gradients (with logit_scale) against float64 too, and unchanged by asking for the stats."""
    temperature, softcap, scale = SETTINGS[setting]
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(11, 16, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(V, 16, generator=generator) * 0.5).to(dtype).requires_grad_()
    target = make_target((11,), V, ignore_every=3)
    logits = torch.nn.functional.linear(hidden, weight).detach()
    target[3] = int(logits[3].float().argmax())
    kwargs = dict(temperature=temperature, softcap=softcap, logit_scale=scale, return_entropy=True, method=method,
                  backend=backend, chunk_size=5 if method == "chunked" else None)
    out = fusedce.linear_token_log_probs(hidden, weight, target, return_stats=True, **kwargs)
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    exact = h64 @ w64.T
    ref = _reference(exact, target, temperature, softcap, scale)
    _check(out, {k: v.detach() for k, v in ref.items()}, 2e-6)
    assert bool(out.is_top1[3])
    adv, beta = torch.randn(11, generator=generator), torch.rand(11, generator=generator)
    (-(adv * out.log_probs).sum() - (beta * out.entropy).sum()).backward()
    (-(adv.double() * ref["log_probs"]).sum() - (beta.double() * ref["entropy"]).sum()).backward()
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    for t, t64 in ((hidden, h64), (weight, w64)):
        err = (t.grad.double() - t64.grad).abs().max().item()
        assert err <= 1e-6 + rtol * t64.grad.abs().max().item()
    plain = fusedce.linear_token_log_probs(hidden.detach(), weight.detach(), target, **kwargs)
    assert isinstance(plain, fusedce.TokenLogProbs)
    assert torch.equal(plain.log_probs, out.log_probs.detach()) and torch.equal(plain.entropy, out.entropy.detach())


def test_not_asked_not_computed(monkeypatch):
    """Without return_stats no statistics code runs (chunked: ChunkCE.token_stats is never called)."""
    def boom(*args, **kwargs):
        raise AssertionError("token_stats called")
    monkeypatch.setattr(TorchChunkCE, "token_stats", staticmethod(boom))
    x, target = _logits(9)
    fusedce.token_log_probs(x, target, return_entropy=True, backend="torch")
    fusedce.linear_token_log_probs(torch.randn(9, 8), torch.randn(V, 8), target, method="chunked", backend="torch")
    with pytest.raises(AssertionError, match="token_stats called"):
        fusedce.token_log_probs(x, target, return_stats=True, backend="torch")


def test_stats_without_entropy_and_errors(backend):
    x, target = _logits(9)
    out = fusedce.token_log_probs(x, target, return_stats=True, backend=backend)
    assert out.entropy is None and out.is_top1.dtype == torch.bool
    empty = fusedce.linear_token_log_probs(torch.randn(0, 8), torch.randn(V, 8), torch.zeros(0, dtype=torch.long),
                                           return_stats=True, backend=backend)
    assert all(getattr(empty, name).shape == (0,) for name in STATS)
    with pytest.raises(TypeError):
        fusedce.token_log_probs(x, target, return_stats=1, backend=backend)
    with pytest.raises(ValueError, match="logit_scale"):
        fusedce.token_log_probs(x, target, logit_scale=0.0, backend=backend)
    with pytest.raises(ValueError, match="logit_scale / temperature"):
        fusedce.token_log_probs(x, target, logit_scale=1e30, temperature=1e-10, backend=backend)


def test_custom_ops_opcheck():
    """The two Triton custom ops (schema, fakes, AOT dispatch), with a row stride > V."""
    from fusedce.backends.triton import token_stats  # noqa: F401  (registers the ops)
    from fusedce.core.options import log_prob_options
    x, target = _logits(9)
    logits = torch.cat([x, x[:, :8]], dim=1)[:, :V]   # row stride V + 8
    lse = torch.logsumexp(logits, dim=1)
    opts = log_prob_options(-100, 0.7, 5.0, 2.0).op_args()
    hidden, weight = torch.randn(9, 16), torch.randn(V, 16)
    ops = torch.ops.fusedce
    for op, args in [(ops.token_stats.default, (logits, target, lse, torch.zeros(9), *opts)),
                     (ops.tiled_forward_token_stats.default, (hidden, weight, None, target, *opts, True))]:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


@pytest.mark.parametrize("method", ["chunked", "tiled"])
def test_compiled_equals_eager_without_graph_break(method):
    """Triton (the custom ops; the PyTorch backend's loops unroll into minutes of Inductor compile on 2
    cores, and test_compile covers tracing them)."""
    backend = "triton"
    hidden = torch.randn(2, 5, 16, requires_grad=True)
    weight = torch.randn(V, 16, requires_grad=True)
    target = make_target((2, 5), V, ignore_every=3)

    def step(h, w, t):
        out = fusedce.linear_token_log_probs(h, w, t, temperature=0.7, softcap=8.0, logit_scale=2.0,
                                             return_entropy=True, return_stats=True, method=method, backend=backend)
        return out.log_probs.sum() + out.entropy.sum(), out.log_sum_sq_probs, out.mean_logits, out.is_top1

    explanation = torch._dynamo.explain(step)(hidden, weight, target)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled, eager = torch.compile(step, fullgraph=True)(hidden, weight, target), step(hidden, weight, target)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
