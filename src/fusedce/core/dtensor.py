"""DTensor inputs at the public entry points (``torch.distributed.tensor.DTensor``).

The ops compute on plain tensors; a DTensor reaching the backends would mix with the plain tensors they
allocate and fail inside torch ("mixed torch.Tensor and DTensor"). At the entry points, as stock torch's
composition does for replicated operands:

- every DTensor argument placed ``Replicate()`` on every mesh dimension (all on one mesh) is replaced by
  its local tensor (``to_local``: differentiable, its gradient comes back as a DTensor of the same
  placements), the op runs on plain tensors, and every tensor it returns becomes a replicated DTensor
  on that mesh again (``from_local``, differentiable; no communication either way);
- any other placement (``Shard``, ``Partial``) is a ``ValueError`` that says what to use instead: the
  full tensor (``full_tensor()``, or ``patch_causal_lm``, whose module hooks let FSDP2 gather the head's
  weight), or, for a head sharded over the vocabulary, the vocab-parallel ops of
  ``fusedce.distributed`` on the local shard.

Plain tensors next to DTensors (e.g. a plain ``target``) are accepted as they are. Without any DTensor
argument the decorator costs one type test per argument; under torch.compile it does nothing (eager only).
"""
from __future__ import annotations

import functools
import inspect

import torch


def _dtensor_class():
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


def _check_replicated(name: str, op: str, value, mesh):
    bad = [p for p in value.placements if not p.is_replicate()]
    if bad:
        raise ValueError(
            f"fusedce.{op}: {name} is a DTensor with placements {tuple(value.placements)}; only DTensors "
            f"replicated on every mesh dimension (Replicate()) are accepted, computed on their local tensor. "
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
