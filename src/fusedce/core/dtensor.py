"""DTensor inputs at the public entry points (``torch.distributed.tensor.DTensor``)."""
from __future__ import annotations

import functools
from typing import Any
import inspect
import numbers

import torch


def _dtensor_class():
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


def replicated_to_local(value):
    """``value.to_local()`` (differentiable) for a DTensor replicated on every mesh dimension, else ``value``."""
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(value, dtensor) and all(p.is_replicate() for p in value.placements):
        return value.to_local()
    return value


# "module.qualname" of a public op -> (its vocabulary-parallel form, {argument: (form's argument, vocab dim)})
VOCAB_PARALLEL: dict = {}


def register_vocab_parallel(op_key: str, form, shards: dict) -> None:
    """Record ``form`` (a ``fusedce.distributed`` op) as the vocabulary-parallel form of the public op ``op_key``
    (``"module.qualname"``)."""
    VOCAB_PARALLEL[op_key] = (form, dict(shards))


def _vocab_shard_dim(value, vocab_dim: int):
    """The mesh dimension of ``value``'s only non-replicated placement, a shard of ``vocab_dim``; else None."""
    sharded = [(i, p) for i, p in enumerate(value.placements) if not p.is_replicate()]
    if len(sharded) != 1:
        return None
    i, p = sharded[0]
    if not p.is_shard() or p.dim % value.ndim != vocab_dim % value.ndim:
        return None
    return i


def _vocab_parallel_call(fn, named: dict, dtensor):
    """Run ``fn``'s vocabulary-parallel form on vocabulary-sharded DTensor arguments; None when it does not apply."""
    entry = VOCAB_PARALLEL.get(f"{fn.__module__}.{fn.__qualname__}")
    sharded = {k: v for k, v in named.items()
               if isinstance(v, dtensor) and not all(p.is_replicate() for p in v.placements)}
    if entry is None or not sharded:
        return None
    form, shards = entry
    target = named.get("target")
    if isinstance(target, dtensor) and target.is_floating_point() and "target" in sharded:
        shards = {**shards, "target": ("target", -1)}   # a probability target sharded like the vocabulary
    mesh: Any = None
    dims: set[int] = set()
    for name, value in sharded.items():
        dim = _vocab_shard_dim(value, shards[name][1]) if name in shards else None
        if dim is None or (mesh is not None and value.device_mesh != mesh):
            return None
        mesh, dims = value.device_mesh, dims | {dim}
    if len(dims) != 1 or not any(shards[n][0] in ("weight_shard", "logits_shard") for n in sharded):
        return None
    for name, value in named.items():   # the rest: replicated on the same mesh, or plain tensors
        if isinstance(value, dtensor) and name not in sharded:
            _check_replicated(name, fn.__name__, value, mesh)
    for name, (_, vocab_dim) in shards.items():
        if name not in sharded and isinstance(named.get(name), torch.Tensor) and named[name].ndim:
            raise ValueError(f"fusedce.{fn.__name__}: the LM head is sharded over the vocabulary, so {name} must be "
                             f"sharded the same way (a DTensor placed Shard({vocab_dim}) on mesh dimension "
                             f"{next(iter(dims))}), or None")
    _pop_unsupported(named, fn.__name__, set(inspect.signature(form).parameters))
    dim = next(iter(dims))
    local = {shards[k][0] if k in shards else k: (v.to_local() if isinstance(v, dtensor) else v)
             for k, v in named.items()}
    if "target" not in sharded:   # a full probability target (plain or replicated): this rank's columns
        local["target"] = _local_columns(local.get("target"), sharded, shards, mesh, dim, dtensor)
    out = form(**local, group=mesh.get_group(dim))
    return _wrap(out, mesh, dtensor)


def _pop_unsupported(named: dict, op: str, takes: set) -> None:
    """Drop the single-process keywords the vocabulary-parallel form (its parameters ``takes``) does not take
    when they hold their defaults; other values: ``ValueError`` naming the keyword."""
    refused = {"method": (("auto", "chunked"), "the vocabulary-parallel linear ops are chunked"),
               "logits_dtype": (("float32",), "the vocabulary-parallel linear ops form fp32 logits"),
               "batch_invariant": ((False,), "the vocabulary-parallel ops do not make a row's results "
                                   "independent of the batch (their chunks and collectives depend on it)")}
    if "top_k" not in takes:
        _pop_truncation(named, op)
    for name, (accepted, why) in refused.items():
        if name in named and name not in takes:
            value = named.pop(name)
            if not any(value is a or (type(value) is type(a) and value == a) for a in accepted):
                raise ValueError(f"fusedce.{op}: {name}={value!r} with a vocabulary-sharded DTensor: {why}; pass "
                                 + " or ".join(f"{name}={a!r}" for a in accepted) + " (or omit it), or the full "
                                 "tensors")


def _pop_truncation(named: dict, op: str) -> None:
    """Drop ``top_k`` / ``top_p`` when off; on is a ``ValueError`` naming the keyword (docs/contract.md,
    "Top-k / top-p")."""
    for name, off, kind in (("top_k", 0, numbers.Integral), ("top_p", 1, numbers.Real)):
        value = named.pop(name, None)
        if value is None or (isinstance(value, kind) and not isinstance(value, bool) and value == off):
            continue
        shown = f"a per-row tensor {name}" if isinstance(value, torch.Tensor) else f"{name}={value!r}"
        raise ValueError(f"fusedce.{op}: {shown} with a vocabulary-sharded DTensor: the sampler's kept set needs a "
                         f"global threshold over the whole vocabulary, which only the LM-head form computes "
                         f"(linear_token_log_probs with a Shard(0) head); pass the full logits for {name} "
                         f"(x.full_tensor(), or x.redistribute(mesh, [Replicate()])), or omit {name} (None: the "
                         f"full softmax)")


def _local_columns(target, sharded: dict, shards: dict, mesh, dim: int, dtensor):
    """A full ``(..., V)`` probability target beside a vocabulary-sharded head -> this rank's columns (no
    communication)."""
    if not (isinstance(target, torch.Tensor) and target.is_floating_point() and target.ndim):
        return target
    vocab = next(v.shape[shards[k][1]] for k, v in sharded.items()   # the global V (a DTensor's shape)
                 if shards[k][0] in ("weight_shard", "logits_shard"))
    if target.shape[-1] != vocab:
        return target   # the op's own shape check names the mismatch
    from torch.distributed.tensor import Replicate, Shard
    placements = [Replicate()] * mesh.ndim
    full = dtensor.from_local(target.detach(), mesh, placements, run_check=False)
    placements[dim] = Shard(target.ndim - 1)
    return full.redistribute(mesh, placements).to_local()


def _check_replicated(name: str, op: str, value, mesh):
    bad = [p for p in value.placements if not p.is_replicate()]
    if bad:
        raise ValueError(
            f"fusedce.{op}: {name} is a DTensor with placements {tuple(value.placements)}; accepted are DTensors "
            f"replicated on every mesh dimension (Replicate(), computed on their local tensor) and, for the ops "
            f"with a vocab-parallel form, an LM head sharded over the vocabulary on one mesh dimension (weight "
            f"Shard(0), logits Shard(-1)). "
            f"Pass the full tensor instead ({name}.full_tensor(), or fusedce.patch_causal_lm, whose module "
            f"hooks let FSDP2 gather the LM head's weight), or, for an LM head sharded over the vocabulary "
            f"(weight Shard(0), logits Shard(-1)), the vocab-parallel ops of fusedce.distributed on "
            f"{name}.to_local() with the mesh's process group.")
    if mesh is not None and value.device_mesh != mesh:
        raise ValueError(f"fusedce.{op}: the DTensor arguments are on different device meshes "
                         f"({mesh} and {value.device_mesh}); pass DTensors of one mesh")
    return value.device_mesh


def _wrap(out, mesh, dtensor):
    from torch.distributed.tensor import Replicate
    placements = [Replicate()] * mesh.ndim
    if isinstance(out, torch.Tensor):
        return dtensor.from_local(out, mesh, placements, run_check=False)
    if isinstance(out, tuple) and hasattr(out, "_fields"):   # CrossEntropyOutput, TokenLogProbs
        return type(out)(*(_wrap(t, mesh, dtensor) for t in out))
    return out


def dtensor_op(fn):
    """Decorator for a public op: replicated DTensor arguments run on their local tensors and the
    results come back as replicated DTensors; other placements raise ``ValueError`` (module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        values = list(args) + list(kwargs.values())
        subclassed = any(isinstance(v, torch.Tensor) and type(v) is not torch.Tensor for v in values)
        if torch.compiler.is_compiling() or not subclassed:
            return fn(*args, **kwargs)
        dtensor = _dtensor_class()
        if dtensor is None or not any(isinstance(v, dtensor) for v in values):
            return fn(*args, **kwargs)
        names = list(inspect.signature(fn).parameters)
        named = {(names[i] if i < len(names) else f"argument {i}"): v for i, v in enumerate(args)}
        routed = _vocab_parallel_call(fn, {**named, **kwargs}, dtensor)
        if routed is not None:
            return routed
        mesh = None
        for index, value in enumerate(args):
            if isinstance(value, dtensor):
                mesh = _check_replicated(names[index] if index < len(names) else f"argument {index}", fn.__name__,
                                         value, mesh)
        for key, value in kwargs.items():
            if isinstance(value, dtensor):
                mesh = _check_replicated(key, fn.__name__, value, mesh)
        local = lambda v: v.to_local() if isinstance(v, dtensor) else v   # noqa: E731
        out = fn(*(local(v) for v in args), **{k: local(v) for k, v in kwargs.items()})
        return _wrap(out, mesh, dtensor)

    return wrapper
