"""DTensor arguments passed straight to the ops (not through the patch's FSDP2 hooks), ``core/dtensor.py``.

Replicated DTensors run as stock torch's composition runs on them: computed on the local tensor, the
results and the gradients come back as DTensors of the same placement, with the values of the same call
on plain tensors (which the other suites check against float64). Any other placement raises a
``ValueError`` naming DTensor and the alternatives. Before ``core/dtensor.py`` both died inside torch
("mixed torch.Tensor and DTensor"). One in-process gloo group of world size 1: Replicate() and
Shard(0) are both placements of a one-rank mesh, so no second process is needed for the refusal.

Shapes (public_ops.py): 10 tokens (two ignored), H = 12, V = 37 (odd).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedce
from public_ops import CALLS, make_inputs, with_logits

dt = pytest.importorskip("torch.distributed.tensor")
from public_ops import BT, H, V  # noqa: E402


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dt.init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


def _replicated(t, mesh):
    out = dt.distribute_tensor(t.detach(), mesh, [dt.Replicate()])
    return out.requires_grad_(t.requires_grad)


def _target():
    target = torch.randint(0, V, (BT,))
    target[2] = target[7] = -100
    return target


def _total(outs):
    """A weighted sum of the outputs (weights 1, 2, 3, 1, ... made like the output: a DTensor for DTensors)."""
    return sum((o.float() * (torch.ones_like(o.float()).reshape(-1).cumsum(0).reshape(o.shape) % 3 + 1)).sum()
               for o in outs if o.requires_grad)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_replicated_dtensors_match_plain_tensors(mesh, name, backend):
    """Every public tensor op (``public_ops.CALLS``, the list the entrance test checks is complete): all
    tensor arguments replicated DTensors -> replicated DTensor results and leaf gradients, bitwise the
    values of the same call on plain tensors."""
    kind, call = CALLS[name]
    if name.startswith("fusedce.nn.") and backend != "torch":
        pytest.skip("torch's drop-in takes no backend (the default backend: torch on CPU)")
    x = make_inputs()
    leaves = ("hidden", "weight", "bias")
    plain = with_logits(x) if kind == "logits" else x
    want = call(plain, backend)
    want_grads = torch.autograd.grad(_total(want), [x[k] for k in leaves], allow_unused=True)

    d = {k: _replicated(v, mesh) for k, v in x.items()}
    got = call(with_logits(d) if kind == "logits" else d, backend)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, dt.DTensor) and g.placements == (dt.Replicate(),)
        torch.testing.assert_close(g.to_local(), w.detach(), rtol=0, atol=0)
    got_grads = torch.autograd.grad(_total(got), [d[k] for k in leaves], allow_unused=True)
    for g, w in zip(got_grads, want_grads):
        if w is None:
            assert g is None
            continue
        assert isinstance(g, dt.DTensor) and g.placements == (dt.Replicate(),)
        torch.testing.assert_close(g.to_local(), w, rtol=0, atol=0)


def test_replicated_logits_and_plain_target_like_stock(mesh):
    """A DTensor of logits with a plain target: the loss is a replicated DTensor, as stock
    ``F.cross_entropy`` on the same DTensor gives, with the same value and gradient type."""
    logits, target = torch.randn(BT, V, requires_grad=True), _target()
    d_logits = _replicated(logits, mesh)
    loss = fusedce.cross_entropy(d_logits, target, backend="torch")
    stock = F.cross_entropy(_replicated(logits, mesh), _replicated(target, mesh))
    assert type(loss) is type(stock) and loss.placements == stock.placements
    torch.testing.assert_close(loss.to_local(), stock.to_local().detach(), rtol=1e-6, atol=1e-6)
    loss.backward()
    (plain_grad,) = torch.autograd.grad(fusedce.cross_entropy(logits, target, backend="torch"), logits)
    assert isinstance(d_logits.grad, dt.DTensor)
    torch.testing.assert_close(d_logits.grad.to_local(), plain_grad, rtol=0, atol=0)


@pytest.mark.parametrize("placement", ["hidden_dim_shard", "partial"])
def test_other_placements_raise_naming_the_alternatives(mesh, placement):
    """A head sharded over its hidden dimension (weight Shard(1), logits Shard(0)) or a Partial sum:
    ValueError (a vocabulary shard, weight Shard(0) / logits Shard(-1), runs: test_dtensor_sharded.py)."""
    hidden, weight, target = torch.randn(BT, H), torch.randn(V, H), _target()

    def placed(t, vocab_dim):
        if placement == "hidden_dim_shard":
            return dt.distribute_tensor(t, mesh, [dt.Shard(1 - vocab_dim)])
        return dt.DTensor.from_local(t, mesh, [dt.Partial()], run_check=False)

    calls = (lambda: fusedce.linear_cross_entropy(hidden, placed(weight, 0), target, backend="torch"),
             lambda: fusedce.linear_token_log_probs(hidden, placed(weight, 0), target, backend="torch"),
             lambda: fusedce.cross_entropy(placed(hidden @ weight.t(), 1), target, backend="torch"),
             lambda: fusedce.token_log_probs(placed(hidden @ weight.t(), 1), target, backend="torch"),
             lambda: fusedce.linear_distillation_loss(hidden, placed(weight, 0), hidden, weight, target,
                                                      backend="torch"))
    for call in calls:
        with pytest.raises(ValueError, match=r"DTensor with placements") as info:
            call()
        assert "vocab-parallel" in str(info.value) and "full_tensor" in str(info.value)


def test_a_vocabulary_shard_without_a_vocab_parallel_form_raises(mesh):
    """The distillation ops have no vocabulary-parallel form: a Shard(0) head is refused, naming it."""
    hidden, weight, target = torch.randn(BT, H), torch.randn(V, H), _target()
    with pytest.raises(ValueError, match=r"DTensor with placements"):
        fusedce.linear_distillation_loss(hidden, dt.distribute_tensor(weight, mesh, [dt.Shard(0)]), hidden, weight,
                                         target, backend="torch")


def test_top_k_top_p_with_a_vocabulary_shard(mesh):
    """``top_k`` / ``top_p`` on a vocabulary-sharded DTensor: a ``Shard(0)`` head runs the vocabulary-parallel
    LM-head form, which computes the global threshold (equal to the op on the full head, scalar or per-row, with
    ``logits_dtype`` and the statistics); ``Shard(-1)`` logits, whose form has no threshold, are a
    ``ValueError`` naming the keyword and the way out; the "off" values (``top_k=0``, ``top_p=1.0``, None) run
    the vocabulary-parallel form with the plain op's values."""
    hidden, weight, target = torch.randn(BT, H), torch.randn(V, H) * 0.5, _target()
    logits = dt.distribute_tensor(hidden @ weight.t(), mesh, [dt.Shard(1)])
    head = dt.distribute_tensor(weight, mesh, [dt.Shard(0)])
    per_row_k, per_row_p = torch.full((BT,), 5), torch.full((BT,), 0.9)
    for name, call in {"top_k": lambda: fusedce.token_log_probs(logits, target, top_k=5),
                       "top_p": lambda: fusedce.token_log_probs(logits, target, top_p=per_row_p,
                                                                return_entropy=True)}.items():
        with pytest.raises(ValueError, match=rf"{name}.*vocabulary-sharded DTensor") as info:
            call()
        assert "full_tensor()" in str(info.value) and "global threshold" in str(info.value)
    for kw in (dict(top_k=per_row_k), dict(top_k=0, top_p=0.5), dict(top_k=3, return_entropy=True),
               dict(top_p=0.9, logits_dtype="input", return_entropy=True), dict(return_stats=True)):
        got = fusedce.linear_token_log_probs(hidden, head, target, backend="torch", **kw)
        want = fusedce.linear_token_log_probs(hidden, weight, target, backend="torch", **kw)
        for g, w in zip(got if isinstance(want, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert (g is None) == (w is None)
            if w is not None:
                torch.testing.assert_close(g.to_local(), w, rtol=0, atol=2e-5, equal_nan=True)
    plain = fusedce.token_log_probs(hidden @ weight.t(), target, backend="torch")
    for off in (dict(top_k=0), dict(top_p=1.0), dict(top_k=None, top_p=None)):
        out = fusedce.token_log_probs(logits, target, backend="torch", **off)
        torch.testing.assert_close(out.to_local(), plain, rtol=0, atol=2e-5)
        out = fusedce.linear_token_log_probs(hidden, head, target, backend="torch", **off)
        torch.testing.assert_close(out.to_local(), plain, rtol=0, atol=2e-5)
