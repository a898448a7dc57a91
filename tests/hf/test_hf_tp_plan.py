"""``patch_causal_lm`` on a Hugging Face model loaded with transformers' tensor parallelism
(``from_pretrained(..., tp_plan="auto")``) on 2 gloo processes (``dist_harness.py``).

transformers shards the LM head "colwise" (its weight a ``Shard(0)`` DTensor: V = 211 rows split 106 /
105, uneven) and the attention / MLP projections col- and row-wise. The patched model's loss reaches
the head's weight as that DTensor, so ``linear_cross_entropy`` runs the vocabulary-parallel op on the
mesh's group (``core/dtensor.py``): each rank multiplies by its own rows, the ``[B, T, V]`` logits are
neither formed nor gathered. Checked: the loss and every parameter's gradient (the local shards of the
DTensor ones) equal the stock TP model's, the vocabulary-parallel Function runs once with the local
``(V_r, H)`` shard, the returned logits are None and the loss is a plain tensor as the stock model's
(``linear_cross_entropy`` returns a replicated DTensor; the patch hands on its local tensor).
One model (Llama), untied and tied.
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

import fusedce  # noqa: E402
from dist_harness import assert_passed, results  # noqa: E402
from hf_models import VOCAB, assert_close, batch, build  # noqa: E402

WORLD = 2
CHECKS = {}   # name -> fn(rank, world), filled below


def _tp_model(tied: bool, directory: str):
    """The tiny Llama of ``hf_models`` (the same weights on every rank: the check's seed), saved by rank 0
    into ``directory`` (transformers writes the config from the main process only) and loaded back by
    every rank with ``tp_plan="auto"`` (which reads the rank and world size from the environment)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    model = build("llama", tied=tied)
    if rank == 0:
        model.save_pretrained(directory)
    dist.barrier()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto", dtype=torch.float32)
    dist.barrier()   # every rank has read the files before rank 0 removes them
    return loaded.eval()


def _shared_directory():
    """A temporary directory made by rank 0, its name sent to every rank."""
    name = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def _local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: _local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}


def _parity(rank, world, tied):
    from torch.distributed.tensor import DTensor, Shard
    import fusedce.distributed.linear as vp
    directory = _shared_directory()
    try:
        model = _tp_model(tied, directory)
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    weight = model.get_output_embeddings().weight
    assert isinstance(weight, DTensor) and weight.placements == (Shard(0),), \
        f"transformers did not shard the head by vocabulary: {type(weight).__name__} " \
        f"{getattr(weight, 'placements', '')}"
    ids, mask, labels = batch(torch.Generator().manual_seed(0))
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    ref, ref_grads = _loss_and_grads(model, inputs)
    fusedce.patch_causal_lm(model)
    shards, stock_apply = [], vp._VocabParallelLinearCE.apply

    def spy(*args):
        shards.append(tuple(args[1].shape))
        return stock_apply(*args)

    vp._VocabParallelLinearCE.apply = spy
    try:
        out, grads = _loss_and_grads(model, inputs)
    finally:
        vp._VocabParallelLinearCE.apply = stock_apply
    rows = _local(weight).shape[0]
    assert shards == [(rows, weight.shape[1])] and rows < VOCAB, f"vocab-parallel calls with shards {shards}"
    assert out.logits is None and type(out.loss) is type(ref.loss), type(out.loss)   # a plain tensor, as stock
    assert_close(out.loss, ref.loss, "loss")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], name)


CHECKS.update({f"{'tied' if tied else 'untied'}_head": functools.partial(_parity, tied=tied) for tied in (False, True)})


@pytest.mark.parametrize("name", list(CHECKS))
def test_patch_causal_lm_tp_plan(name, request, tmp_path_factory):
    outcome = results(__name__, CHECKS, WORLD, "torch", request, tmp_path_factory)[name]
    assert_passed(outcome, WORLD)
