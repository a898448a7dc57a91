"""patch_causal_lm under FSDP2 (``torch.distributed.fsdp.fully_shard``) on CPU: 2 ranks, gloo.

Configurations: the head wrapped on its own (``fully_shard(model.lm_head)`` then the root: the head is
unsharded only inside its own forward and re-gathered by FSDP2's pre-backward hook on its output), and
the whole model wrapped once (tied and untied head); the patch applied before or after sharding. Each rank
trains on its own batch (``hf_models.batch`` with a per-rank seed); FSDP2 averages the gradients over the
ranks, so the reference is the mean of the two single-process gradients of the unpatched, unsharded
model. Loss (per rank) and every gradient (``full_tensor()``) are compared with ``hf_models``' tolerance.
The group is spawned once for the module (``_results``) and every configuration runs in it.
"""
from __future__ import annotations

import copy
import json
import os
import socket
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from fusedce.integrations.hf.patch import patch_causal_lm  # noqa: E402
from dist_harness import start_ranks  # noqa: E402
from hf_models import batch, build  # noqa: E402
from tolerances import HF_ATOL_SCALE, HF_RTOL  # noqa: E402

WORLD = 2
# name -> (tied head, shard the head on its own, patch before sharding)
CONFIGS = {
    "head wrapped alone, patch before": (False, True, True),
    "head wrapped alone, patch after": (False, True, False),
    "whole model, untied": (False, False, True),
    "whole model, tied": (True, False, False),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _check(rank: int, tied: bool, head_alone: bool, patch_first: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)   # the same initial model on every rank
    plain = build("llama", tied=tied)
    batches = [batch(torch.Generator().manual_seed(100 + r)) for r in range(WORLD)]
    reference, losses = {}, []
    for ids, mask, labels in batches:   # single process, unsharded, unpatched: mean of the ranks' grads
        model = copy.deepcopy(plain)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        for n, g in _grads(model).items():
            reference[n] = reference.get(n, 0) + g / WORLD
    model = copy.deepcopy(plain)
    if patch_first:
        patch_causal_lm(model)
    mesh = init_device_mesh("cpu", (WORLD,))
    if head_alone:
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not patch_first:
        patch_causal_lm(model)
    ids, mask, labels = batches[rank]
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is None and out.loss.grad_fn is not None
    out.loss.backward()
    grads = {n: g.full_tensor() for n, g in _grads(model).items()}
    assert grads.keys() == reference.keys(), sorted(set(grads) ^ set(reference))
    loss_diff = abs(float(out.loss.detach() - losses[rank]))
    grad_diff = max(float((grads[n] - reference[n]).abs().max()) for n in grads)
    torch.testing.assert_close(out.loss.detach(), losses[rank], rtol=HF_RTOL, atol=0.0, msg="loss")
    for n, g in grads.items():
        scale = float(reference[n].abs().max())
        torch.testing.assert_close(g, reference[n], rtol=HF_RTOL, atol=HF_ATOL_SCALE * scale + 1e-12, msg=n)
    return {"loss_diff": loss_diff, "max_grad_diff": grad_diff}


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    results = {}
    try:
        for name, config in CONFIGS.items():
            try:
                results[name] = _check(rank, *config)
            except Exception:  # noqa: BLE001 - reported by the configuration's own test
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def _results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    try:
        start_ranks(_worker, (_free_port(), str(out)), WORLD, preload=["transformers"])
    except Exception:  # noqa: BLE001
        return [{name: {"error": traceback.format_exc()} for name in CONFIGS}]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fsdp2_loss_and_gradients_match_single_process(_results, name):
    for rank, results in enumerate(_results):
        result = results[name]
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
