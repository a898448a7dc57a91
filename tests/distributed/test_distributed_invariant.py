"""``batch_invariant=True`` of ``vocab_parallel_linear_token_log_probs`` on 2 and 3 gloo ranks, each backend
(Triton under the interpreter): a probe token's log-prob, entropy and hidden-gradient row keep every bit
whatever batch it is placed in (sizes 2-129, positions, ``chunk_size``, ignored neighbours), with the ranks'
sums folded in rank order; the values are the op's without the flag to fp32 rounding; a ``(..., K)`` target
and a non-bool flag are refused before any collective.

Shapes: V = 37 split unevenly (17 + 20, 11 + 13 + 13), H = 16, fp32.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fusedce.distributed as fd
from dist_harness import assert_passed, over_worlds, results

V, H, PROBE = 37, 16, 5
SIZES = {2: (17, 20), 3: (11, 13, 13)}
# (batch size, position of the probe, chunk_size, ignore every other neighbour)
PLACEMENTS = ((2, 1, None, False), (7, 3, None, False), (70, 0, None, False), (70, 69, 16, False),
              (130, 65, None, True), (129, 128, 8, False))
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _inputs():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(140, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.5
    return hidden, weight, torch.randint(0, V, (140,), generator=gen)


def _shard(weight):
    sizes = SIZES[dist.get_world_size()]
    start = sum(sizes[:dist.get_rank()])
    return weight[start:start + sizes[dist.get_rank()]]


def _probe(hidden, shard, target, placement, **options):
    """``(log_prob, entropy, grad_hidden row)`` of the probe token in one placement."""
    size, pos, chunk_size, ignore_neighbours = placement
    others = [i for i in range(hidden.shape[0]) if i != PROBE][: size - 1]
    pos = min(pos, len(others))
    order = others[:pos] + [PROBE] + others[pos:]
    h = hidden[order].clone().requires_grad_()
    t = target[order].clone()
    if ignore_neighbours:
        t[torch.arange(len(order)) % 2 == (pos + 1) % 2] = -100
    out = fd.vocab_parallel_linear_token_log_probs(h, shard, t, return_entropy=True, chunk_size=chunk_size,
                                                  **options)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    return out.log_probs[pos].detach(), out.entropy[pos].detach(), h.grad[pos].detach()


@check
def probe_keeps_its_bits(rank, world):
    hidden, weight, target = _inputs()
    shard = _shard(weight)
    alone = _probe(hidden, shard, target, (1, 0, None, False), batch_invariant=True)
    for placement in PLACEMENTS:
        got = _probe(hidden, shard, target, placement, batch_invariant=True)
        for a, b, what in zip(alone, got, ("log-prob", "entropy", "hidden-gradient row")):
            assert torch.equal(a, b), f"the probe's {what} changed in placement {placement}"
    plain = _probe(hidden, shard, target, PLACEMENTS[2])
    for a, b, what in zip(alone, plain, ("log-prob", "entropy", "hidden-gradient row")):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"{what}: {a} vs the op without the flag {b}"


@check
def refused_before_any_collective(rank, world):
    hidden, weight, target = _inputs()
    shard = _shard(weight)
    with pytest.raises(ValueError, match=r"batch_invariant=True does not support a \(\.\.\., K\) target"):
        fd.vocab_parallel_linear_token_log_probs(hidden[:4], shard, target[:8].view(4, 2), batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        fd.vocab_parallel_linear_token_log_probs(hidden[:4], shard, target[:4], batch_invariant=1)


@pytest.mark.parametrize("name", list(CHECKS))
@over_worlds
def test_vocab_parallel_batch_invariant(world, backend, name, request, tmp_path_factory):
    """Every check on 2 and 3 gloo ranks (``dist_harness.WORLD_BACKENDS``)."""
    outcome = results(__name__, CHECKS, world, backend, request, tmp_path_factory)[name]
    assert_passed(outcome, world)
