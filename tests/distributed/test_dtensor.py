"""DTensor arguments passed straight to the ops (not through the patch's FSDP2 hooks), ``core/dtensor.py``.

Replicated DTensors run as stock torch's composition runs on them: computed on the local tensor, the
results and the gradients come back as DTensors of the same placement, with the values of the same call
on plain tensors (which the other suites check against float64). Any other placement raises a
``ValueError`` naming DTensor and the alternatives. Before ``core/dtensor.py`` both died inside torch
("mixed torch.Tensor and DTensor"). One in-process gloo group of world size 1: Replicate() and
Shard(0) are both placements of a one-rank mesh, so no second process is needed for the refusal.

Shapes: 10 tokens (two ignored), H = 12, V = 37 (odd).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedce

dt = pytest.importorskip("torch.distributed.tensor")
BT, H, V = 10, 12, 37


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


def _scalar(out):
    return out.log_probs.sum() + 0.3 * out.entropy.sum() if isinstance(out, fusedce.TokenLogProbs) else out


OPS = {
    "cross_entropy": lambda h, w, t: fusedce.cross_entropy(h @ w.t(), t, label_smoothing=0.1, backend="torch"),
    "linear-chunked": lambda h, w, t: fusedce.linear_cross_entropy(h, w, t, method="chunked", backend="torch"),
    "linear-tiled": lambda h, w, t: fusedce.linear_cross_entropy(h, w, t, method="tiled", reduction="sum",
                                                                 backend="torch"),
    "linear-stats": lambda h, w, t: fusedce.linear_cross_entropy(h, w, t, return_stats=True, backend="torch").loss,
    "token_log_probs": lambda h, w, t: fusedce.token_log_probs(h @ w.t(), t, return_entropy=True, backend="torch"),
    "linear_token_log_probs": lambda h, w, t: fusedce.linear_token_log_probs(
        h, w, t, method="tiled", return_entropy=True, backend="torch"),
}


@pytest.mark.parametrize("op", list(OPS))
def test_replicated_dtensors_match_plain_tensors(mesh, op):
    fn = OPS[op]
    hidden, weight, target = torch.randn(BT, H, requires_grad=True), torch.randn(V, H, requires_grad=True), _target()
    want = fn(hidden, weight, target)
    _scalar(want).backward()

    d_hidden, d_weight, d_target = _replicated(hidden, mesh), _replicated(weight, mesh), _replicated(target, mesh)
    got = fn(d_hidden, d_weight, d_target)
    outs = tuple(got) if isinstance(got, tuple) else (got,)
    for t, w in zip(outs, tuple(want) if isinstance(want, tuple) else (want,)):
        assert isinstance(t, dt.DTensor) and t.placements == (dt.Replicate(),)
        torch.testing.assert_close(t.to_local(), w.detach(), rtol=0, atol=0)
    _scalar(got).backward()
    for d, plain in ((d_hidden, hidden), (d_weight, weight)):
        assert isinstance(d.grad, dt.DTensor) and d.grad.placements == (dt.Replicate(),)
        torch.testing.assert_close(d.grad.to_local(), plain.grad, rtol=0, atol=0)


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


@pytest.mark.parametrize("placement", ["shard", "partial"])
def test_other_placements_raise_naming_the_alternatives(mesh, placement):
    """A vocabulary-sharded head (weight Shard(0), logits Shard(1)) or a Partial sum: ValueError."""
    hidden, weight, target = torch.randn(BT, H), torch.randn(V, H), _target()

    def placed(t, dim):
        if placement == "shard":
            return dt.distribute_tensor(t, mesh, [dt.Shard(dim)])
        return dt.DTensor.from_local(t, mesh, [dt.Partial()], run_check=False)

    calls = (lambda: fusedce.linear_cross_entropy(hidden, placed(weight, 0), target, backend="torch"),
             lambda: fusedce.linear_token_log_probs(hidden, placed(weight, 0), target, backend="torch"),
             lambda: fusedce.cross_entropy(placed(hidden @ weight.t(), 1), target, backend="torch"),
             lambda: fusedce.token_log_probs(placed(hidden @ weight.t(), 1), target, backend="torch"))
    for call in calls:
        with pytest.raises(ValueError, match=r"DTensor with placements") as info:
            call()
        assert "vocab-parallel" in str(info.value) and "full_tensor" in str(info.value)
