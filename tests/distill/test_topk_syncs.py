"""Host syncs of the top-k distillation (issue 46 item 3): the contract's one compaction of the LM head's
ignored tokens (one host sync: ``lm_head/head.compact_rows``) and one read each for the range check
and the teacher-value check. Before, ``linear_topk_distillation_loss(tail=True)`` compacted twice (the K-class
op, then the tail pass; three times with a hard label at another temperature), and the range check read the
host twice when the target was not folded into the K classes (the target, then the teacher ids).

Counted as the aten calls that need the host: ``nonzero`` (an output size from the values) and
``_local_scalar_dense`` (``bool()`` / ``int()`` / ``item()``), under a dispatch mode that sees every op the
calling thread runs."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedce

N, H, V, K = 12, 16, 50, 3
HOST = ("nonzero", "_local_scalar_dense")


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    lp, ids = torch.log_softmax(torch.randn(N, V, generator=g), dim=-1).topk(K, dim=-1)
    target = torch.randint(0, V, (N,), generator=g)
    target[::3] = -100
    return hidden, weight, ids, lp, target


OPTIONS = {"tail": dict(tail=True), "tail+hard@T=2": dict(tail=True, hard_label_weight=0.5, temperature=2.0),
           "tail+hard@T=1": dict(tail=True, hard_label_weight=0.5), "hard@T=2": dict(hard_label_weight=0.5,
                                                                                       temperature=2.0)}


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("method", ["chunked", "tiled"])
def test_linear_form_compacts_once(method, options):
    hidden, weight, ids, lp, target = _inputs()
    with _HostReads() as reads:
        loss = fusedce.linear_topk_distillation_loss(hidden, weight, ids, lp, target, method=method, backend="torch",
                                                     **OPTIONS[options])
    assert reads.count["nonzero"] == 1, f"{reads.count['nonzero']} compactions (one host sync each)"
    assert reads.count["_local_scalar_dense"] == 2, (
        f"{reads.count['_local_scalar_dense']} host reads: one for the ranges, one for the teacher's values")
    loss.backward()   # the backward reads nothing back
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


@pytest.mark.parametrize("options", list(OPTIONS))
def test_logits_form_reads_the_host_twice(options):
    hidden, weight, ids, lp, target = _inputs()
    logits = (hidden @ weight.t()).detach().requires_grad_()
    with _HostReads() as reads:
        fusedce.topk_distillation_loss(logits, ids, lp, target, backend="torch", **OPTIONS[options])
    assert reads.count == Counter(_local_scalar_dense=2), dict(reads.count)
