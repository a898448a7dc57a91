"""Vocabulary-sharded DTensors into the public ops (``core/dtensor.py`` -> ``fusedce.distributed``), on 2
and 3 gloo ranks (3: V = 37 splits 13 + 13 + 11, uneven), on a 1-D mesh and on the tensor-parallel
dimension of a 2 x 1 or 3 x 1 mesh (a 2-D mesh whose other dimension has size 1, the shape a
data-parallel x tensor-parallel mesh has on one data-parallel rank).

Each check builds the same inputs on every rank, computes the single-process op on plain full tensors,
then the same op with the LM head (weight, bias, class weights) a ``Shard(0)`` DTensor, or the logits a
``Shard(-1)`` DTensor, hidden states replicated (or a plain tensor): the results must be replicated
DTensors with the single-process values, and the gradients DTensors in the inputs' placements whose full
tensors equal the single-process gradients, within the bounds of test_distributed_log_probs.py (the two
paths sum the same fp32 terms in another order: per-row statistics merged across ranks, H-term dot
products): outputs 2e-5 absolute, gradients 2^-16 of their largest magnitude.

Shapes: 10 tokens (two ignored), H = 12, V = 37.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fusedce
from dist_harness import assert_passed, over_worlds, results
from tolerances import FP32_MATH_ATOL, LINEAR_MAX_RTOL

BT, H, V = 10, 12, 37
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _dt():
    from torch.distributed import tensor as dt
    from torch.distributed.device_mesh import init_device_mesh
    return dt, init_device_mesh


def _inputs():
    target = torch.randint(0, V, (BT,))
    target[2] = target[7] = -100
    return (torch.randn(BT, H), torch.randn(V, H) * 0.5, torch.randn(V) * 0.1, torch.rand(V) + 0.5, target)


def _mesh(world, two_d):
    dt, init_device_mesh = _dt()
    if two_d:
        return init_device_mesh("cpu", (world, 1), mesh_dim_names=("tp", "dp")), 0
    return init_device_mesh("cpu", (world,)), 0


def _placements(mesh, tp_dim, shard_dim):
    dt, _ = _dt()
    out = [dt.Replicate()] * mesh.ndim
    if shard_dim is not None:
        out[tp_dim] = dt.Shard(shard_dim)
    return out


def _put(t, mesh, tp_dim, shard_dim):
    dt, _ = _dt()
    return dt.distribute_tensor(t.detach(), mesh, _placements(mesh, tp_dim, shard_dim)).requires_grad_(t.requires_grad)


def _grad_atol(ref):
    return LINEAR_MAX_RTOL * max(float(ref.abs().max()), 1.0)


def _outputs(out):
    return tuple(out) if isinstance(out, tuple) else (out,)


def _compare(world, two_d, run, leaves_spec):
    """``run(tensors) -> outputs``; ``leaves_spec``: {name: shard dim or None (replicated) or 'plain'}."""
    dt, _ = _dt()
    hidden, weight, bias, cw, target = _inputs()
    plain = {"hidden": hidden.requires_grad_(), "weight": weight.requires_grad_(), "bias": bias.requires_grad_(),
             "ce_weight": cw, "target": target}
    plain["logits"] = hidden @ weight.t() + bias
    want = _outputs(run(plain))
    leaves = [k for k in ("hidden", "weight", "bias") if k in leaves_spec or "logits" in leaves_spec]
    def total(outs):
        return sum((o.float() * (1 + 0.5 * torch.ones_like(o.float()).reshape(-1).cumsum(0).reshape(o.shape) % 3)).sum()
                   for o in outs if o.requires_grad)
    want_grads = torch.autograd.grad(total(want), [plain[k] for k in leaves], allow_unused=True)

    mesh, tp = _mesh(world, two_d)
    d = {}
    for name, spec in leaves_spec.items():
        value = plain[name] if name != "logits" else None
        if name == "logits":
            continue
        d[name] = value.detach().requires_grad_(value.requires_grad) if spec == "plain" else _put(value, mesh, tp, spec)
    d["target"] = target
    if "logits" in leaves_spec:   # logits made from the replicated leaves, then sharded over the vocabulary
        d["hidden"] = _put(hidden, mesh, tp, None)
        d["weight"] = _put(weight, mesh, tp, None)
        d["bias"] = _put(bias, mesh, tp, None)
        full = d["hidden"] @ d["weight"].t() + d["bias"]
        d["logits"] = full.redistribute(mesh, _placements(mesh, tp, -1))
    got = _outputs(run(d))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, dt.DTensor) and all(p.is_replicate() for p in g.placements), g
        torch.testing.assert_close(g.to_local(), w.detach(), rtol=0, atol=FP32_MATH_ATOL)
    got_grads = torch.autograd.grad(total(got), [d[k] for k in leaves], allow_unused=True)
    for name, g, w in zip(leaves, got_grads, want_grads):
        spec = leaves_spec.get(name, None)
        if spec == "plain":
            assert not isinstance(g, dt.DTensor)
            torch.testing.assert_close(g, w, rtol=0, atol=_grad_atol(w))
            continue
        assert isinstance(g, dt.DTensor), name
        if spec is not None and "logits" not in leaves_spec:
            assert g.placements == tuple(_placements(mesh, tp, spec)), (name, g.placements)
        torch.testing.assert_close(g.full_tensor(), w, rtol=0, atol=_grad_atol(w))


def _cases(two_d):
    F = fusedce
    return {
        "linear_cross_entropy": (lambda x: F.linear_cross_entropy(x["hidden"], x["weight"], x["target"], x["bias"],
                                                                  ce_weight=x["ce_weight"], label_smoothing=0.1,
                                                                  lse_square_scale=1e-3, return_stats=True)[:3],
                                 {"hidden": None, "weight": 0, "bias": 0, "ce_weight": 0}),
        "linear_cross_entropy_plain_hidden": (lambda x: F.linear_cross_entropy(x["hidden"], x["weight"], x["target"],
                                                                               reduction="none"),
                                              {"hidden": "plain", "weight": 0}),
        "linear_token_log_probs": (lambda x: F.linear_token_log_probs(x["hidden"], x["weight"], x["target"], x["bias"],
                                                                      temperature=0.7, return_entropy=True),
                                   {"hidden": None, "weight": 0, "bias": 0}),
        "cross_entropy": (lambda x: F.cross_entropy(x["logits"], x["target"], label_smoothing=0.1), {"logits": -1}),
        "token_log_probs": (lambda x: F.token_log_probs(x["logits"], x["target"], return_entropy=True),
                            {"logits": -1}),
    }


def _register():
    for two_d in (False, True):
        for name, (run, spec) in _cases(two_d).items():
            def fn(rank, world, run=run, spec=spec, two_d=two_d):
                _compare(world, two_d, run, spec)
            fn.__name__ = f"{name}_{'2d' if two_d else '1d'}"
            check(fn)


_register()


@check
def tiled_is_refused_with_a_vocabulary_shard(rank, world):
    hidden, weight, _, _, target = _inputs()
    mesh, tp = _mesh(world, False)
    with pytest.raises(ValueError, match="method='tiled'.*vocabulary-parallel linear ops are chunked"):
        fusedce.linear_cross_entropy(hidden, _put(weight, mesh, tp, 0), target, method="tiled")


@check
def a_replicated_bias_with_a_sharded_head_is_refused(rank, world):
    hidden, weight, bias, _, target = _inputs()
    mesh, tp = _mesh(world, False)
    with pytest.raises(ValueError, match="bias must be sharded the same way"):
        fusedce.linear_cross_entropy(hidden, _put(weight, mesh, tp, 0), target, _put(bias, mesh, tp, None))
    assert dist.is_initialized()


@pytest.mark.parametrize("name", list(CHECKS))
@over_worlds
def test_vocabulary_sharded_dtensors(world, backend, name, request, tmp_path_factory):
    """Every check on 2 and 3 gloo ranks (``dist_harness.WORLD_BACKENDS``)."""
    outcome = results(__name__, CHECKS, world, backend, request, tmp_path_factory)[name]
    assert_passed(outcome, world)
