"""``fusedce.integrations.torchtitan`` on 2 gloo ranks (``dist_harness.py``), against torchtitan 0.3.0's own
``ChunkedLossWrapper`` + ``CrossEntropyLoss`` driven the same way (fp32, torch's default tolerances):

- TP under the ``partial_dtensor`` backend: the head ``ColwiseParallel`` (its weight a ``Shard(0)`` DTensor,
  uneven rows 21 / 20), fusedce through its DTensor vocabulary-parallel path;
- TP under the ``spmd_types`` backend (torchtitan's default): plain local rows and the current SPMD mesh's
  ``"tp"`` group; the hidden-state gradient is a partial sum there (the decoder's norm boundary all-reduces
  it), so the ranks' sums are compared, and each rank's head rows;
- FSDP2 (``fully_shard`` on the head and on the root, data parallel: each rank its own batches, the global
  token count, 2 microbatches accumulated): the head's parameters as FSDP hands them, its gradient
  reduce-scattered by FSDP;
- CP: ``pred`` / ``labels`` DTensors sharded over the sequence, against the stock loss on the local rows.

- PP: 2 stages (``torch.distributed.pipelining``, GPipe, 2 microbatches), the loss on the last stage as
  torchtitan hands it to the schedule; every stage's gradients and the microbatch losses.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan", reason="torchtitan is installed by `make install`")

from dist_harness import assert_passed, results  # noqa: E402
from titan_models import IGNORE_INDEX, V, Tail, batch, fused_loss, run, stock_loss  # noqa: E402

WORLD = 2
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _mesh(name):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (WORLD,), mesh_dim_names=(name,))


def _close_grads(stock_model, fused_model, full=lambda t: t):
    for (name, p), q in zip(stock_model.named_parameters(), fused_model.parameters()):
        torch.testing.assert_close(full(q.grad), full(p.grad), msg=name)


@check
def tp_dtensor_head(rank, world):
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torchtitan.distributed.utils import set_spmd_backend
    set_spmd_backend("partial_dtensor")
    try:
        mesh = _mesh("tp")
        stock_model = Tail()
        fused_model = copy.deepcopy(stock_model)
        for m in (stock_model, fused_model):
            parallelize_module(m.lm_head, mesh, ColwiseParallel(use_local_output=False))
        assert isinstance(fused_model.lm_head.weight, DTensor)
        assert fused_model.lm_head.weight.placements == (Shard(0),)
        assert fused_model.lm_head.weight.to_local().shape[0] == (21, 20)[rank]
        x, labels = batch()
        gvt = (labels != IGNORE_INDEX).sum()
        stock, _ = run(stock_loss(), stock_model, x, labels, gvt)
        fused, _ = run(fused_loss(), fused_model, x, labels, gvt)
        torch.testing.assert_close(fused, stock)
        _close_grads(stock_model, fused_model, lambda t: t.full_tensor() if isinstance(t, DTensor) else t)
    finally:
        set_spmd_backend("spmd_types")


@check
def tp_spmd_types_local_rows(rank, world):
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh
    from torchtitan.distributed.utils import get_spmd_backend
    assert get_spmd_backend() == "spmd_types"
    mesh = _mesh("tp")
    full = Tail()
    rows = -(-V // world)   # torchtitan's _LossParallelCrossEntropy rows: ceil(V / TP), the last rank fewer
    start, stop = rank * rows, min(V, (rank + 1) * rows)
    stock_model = Tail(stop - start)
    with torch.no_grad():
        stock_model.proj.weight.copy_(full.proj.weight)
        stock_model.lm_head.weight.copy_(full.lm_head.weight[start:stop])
    fused_model = copy.deepcopy(stock_model)
    x, labels = batch()
    gvt = (labels != IGNORE_INDEX).sum()
    x_s, x_f = x.clone().requires_grad_(), x.clone().requires_grad_()
    with set_current_spmd_mesh(mesh):
        stock, _ = run(stock_loss(V), stock_model, x_s, labels, gvt)
        fused, _ = run(fused_loss(), fused_model, x_f, labels, gvt)
    torch.testing.assert_close(fused, stock)
    torch.testing.assert_close(fused_model.lm_head.weight.grad, stock_model.lm_head.weight.grad)
    # partial sums over TP on both sides (what the norm boundary all-reduces): compare their sums
    for a in (x_s.grad, x_f.grad, stock_model.proj.weight.grad, fused_model.proj.weight.grad):
        dist.all_reduce(a)
    torch.testing.assert_close(x_f.grad, x_s.grad)
    torch.testing.assert_close(fused_model.proj.weight.grad, stock_model.proj.weight.grad)


@check
def fsdp2_data_parallel(rank, world):
    from torch.distributed.fsdp import fully_shard
    mesh = _mesh("dp")
    stock_model = Tail()
    fused_model = copy.deepcopy(stock_model)
    for m in (stock_model, fused_model):
        fully_shard(m.lm_head, mesh=mesh)
        fully_shard(m, mesh=mesh)
    stock_fn, fused_fn = stock_loss(), fused_loss()
    for micro in range(2):             # gradient accumulation over 2 microbatches
        x, labels = batch(10 + 2 * rank + micro)   # each rank its own batch
        gvt = (labels != IGNORE_INDEX).sum()
        dist.all_reduce(gvt)           # the trainer's global_valid_tokens
        stock, _ = run(stock_fn, stock_model, x, labels, gvt)
        fused, _ = run(fused_fn, fused_model, x, labels, gvt)
        torch.testing.assert_close(fused, stock)
    _close_grads(stock_model, fused_model, lambda t: t.full_tensor())
    assert fused_model.lm_head.weight.grad.to_local().shape[0] == (21, 20)[rank]   # reduce-scattered


@check
def cp_dtensor_sequence_shards(rank, world):
    """``pred`` / ``labels`` DTensors sharded over the sequence (CP): each rank's local rows, the
    hidden-state gradient a DTensor of ``pred``'s placements; compared with the stock loss on the local
    rows (what ChunkedLossWrapper's ``local_map`` computes)."""
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.distributed.utils import set_spmd_backend
    set_spmd_backend("partial_dtensor")
    try:
        mesh = _mesh("cp")
        stock_model = Tail()
        fused_model = copy.deepcopy(stock_model)
        x, labels = batch()
        half = x.shape[1] // world
        x_local, labels_local = x[:, rank * half:(rank + 1) * half], labels[:, rank * half:(rank + 1) * half]
        gvt = (labels != IGNORE_INDEX).sum()
        stock, _ = run(stock_loss(), stock_model, x_local, labels_local, gvt)
        loss_fn = fused_loss()
        loss_fn.set_lm_head(fused_model.lm_head)
        pred = DTensor.from_local(fused_model(x_local), mesh, (Shard(1),))
        leaf = pred.detach().requires_grad_()
        fused, metrics = loss_fn(leaf, DTensor.from_local(labels_local, mesh, (Shard(1),)), gvt)
        fused.backward()
        assert metrics == {} and leaf.grad.placements == (Shard(1),)
        torch.testing.assert_close(fused, stock)
        torch.testing.assert_close(fused_model.lm_head.weight.grad, stock_model.lm_head.weight.grad)
        pred_s = stock_model(x_local).detach().requires_grad_()
        stock_fn = stock_loss()
        stock_fn.set_lm_head(copy.deepcopy(stock_model.lm_head))
        stock_fn(pred_s, labels_local, gvt)[0].backward()
        torch.testing.assert_close(leaf.grad.to_local(), pred_s.grad)
    finally:
        set_spmd_backend("spmd_types")


def _pp_grads(loss_cfg_fn, rank, x, labels, gvt):
    """2 pipeline stages (rank 0: the first ``proj``; rank 1: a second ``proj`` and the head), GPipe over 2
    microbatches, the loss handed to the schedule as torchtitan does (``_scalar_loss_fn``, unscaled)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    torch.manual_seed(123)
    first, last = torch.nn.Linear(x.shape[-1], x.shape[-1], bias=False), Tail()
    part = first if rank == 0 else last
    loss_fn = loss_cfg_fn()
    if rank == 1:
        loss_fn.set_lm_head(last.lm_head)
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda pred, y: loss_fn(pred, y, gvt)[0],
                             scale_grads=False)
    for _ in range(2):   # the first step also infers the stages' shapes (a loss call on an unfilled buffer)
        part.zero_grad(set_to_none=True)
        losses = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=labels, losses=losses)
    return [p.grad for p in part.parameters()], losses


@check
def pp_last_stage(rank, world):
    """Against torchtitan's ChunkedLossWrapper on the same schedule and plain autograd through the same two
    stages (logits, ``F.cross_entropy`` sum / gvt per microbatch). The second step is compared: the first
    one's shape inference calls the loss on an unfilled receive buffer (both losses then write its
    gradients, as they compute the head's gradient during the loss call)."""
    import torch.nn.functional as F
    x, labels = batch()
    gvt = (labels != IGNORE_INDEX).sum()
    fused_grads, fused_losses = _pp_grads(fused_loss, rank, x, labels, gvt)
    stock_grads, stock_losses = _pp_grads(stock_loss, rank, x, labels, gvt)
    for a, b in zip(fused_grads + fused_losses, stock_grads + stock_losses):
        torch.testing.assert_close(a, b)
    torch.manual_seed(123)
    first, last = torch.nn.Linear(x.shape[-1], x.shape[-1], bias=False), Tail()
    ref_losses = []
    for xm, ym in zip(x.chunk(2), labels.chunk(2)):
        logits = last.lm_head(last(first(xm)))
        loss = F.cross_entropy(logits.flatten(0, 1), ym.flatten(), reduction="sum", ignore_index=IGNORE_INDEX) / gvt
        loss.backward()
        ref_losses.append(loss.detach())
    ref_grads = [p.grad for p in (first if rank == 0 else last).parameters()]
    assert len(fused_grads) == len(ref_grads) == (1 if rank == 0 else 2)
    for a, b in zip(fused_grads, ref_grads):
        torch.testing.assert_close(a, b)
    if rank == 1:
        torch.testing.assert_close(torch.stack(fused_losses), torch.stack(ref_losses))


@pytest.mark.parametrize("name", list(CHECKS))
def test_torchtitan_two_ranks(name, request, tmp_path_factory):
    outcome = results(__name__, CHECKS, WORLD, "torch", request, tmp_path_factory)[name]
    assert_passed(outcome, WORLD)
