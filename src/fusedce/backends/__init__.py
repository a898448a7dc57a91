"""Backend selection. Each backend package exposes the same small interface:

- ``cross_entropy_rows(logits2d, target1d, weight, opts, inplace_backward, stats)``
  -> ``(ce_row, lse, lse_lo, predicted)``: per-row fp32 cross-entropy WITHOUT the z-loss and per-row
  fp32 lse (both differentiable w.r.t. ``logits2d``; 0 on ignored rows), lse's fp32 rounding error
  (``lse + lse_lo`` exact; no gradient), int64 argmax (-1 on ignored rows); no reduction. The z-loss is built from ``lse`` by ``reduction.py``, so its gradient reaches the backend
  as the upstream gradient of ``lse``.
- ``linear_cross_entropy(..., reduction, scales, ...)``: the LM head fused with the loss, reduced
  (``scales`` = the mean's 1/D and 1/N), see ``backends/chunk_loop/api.py``.
- ``slice_stats`` / ``slice_grad``: the same math on a vocabulary slice (partial row statistics out,
  the slice's gradient from the global statistics in), for ``integrations/distributed``.

Packages: ``pytorch/`` is the backend named ``"torch"`` (the CPU path), ``triton/`` the backend named
``"triton"``; ``chunk_loop/`` is not a backend but what both share: the backend-agnostic LM-head chunk
loop of ``linear_cross_entropy``, into which each backend plugs its per-chunk cross-entropy.
"""
from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "triton")


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


PLANNED = ("cute",)   # named by docs/contract.md, not in this version (the CuTe DSL backend)


def check_name(name) -> None:
    """``ValueError`` listing the valid names unless ``name`` is one of ``BACKENDS`` (device-independent:
    the modules call it at construction; ``resolve`` also checks the device); ``RuntimeError`` for a
    backend the contract names that this version does not have."""
    if name in PLANNED:
        raise RuntimeError(f"backend={name!r} (the CuTe DSL backend) is not available in fusedce "
                           f"{_version()}: it is planned; valid names now are {BACKENDS}")
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid names are {BACKENDS}")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("fusedce")
    except PackageNotFoundError:
        return "(source tree)"


def resolve(name, device: torch.device) -> str:
    """Map ``backend=`` (None -> ``$FUSEDCE_BACKEND`` or ``"auto"``; an empty ``$FUSEDCE_BACKEND`` is
    ``"auto"`` too) to a concrete backend name.

    ``"auto"``: ``"triton"`` on CUDA tensors, ``"torch"`` otherwise. Raises ``ValueError`` for an unknown
    name and ``RuntimeError`` for ``"triton"`` on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    if name is None:
        name = os.environ.get("FUSEDCE_BACKEND") or "auto"   # unset or empty: auto
    check_name(name)
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            "backend='triton' needs CUDA tensors; on CPU it runs only under the Triton interpreter "
            "(set TRITON_INTERPRET=1 before importing triton), which is meant for tests"
        )
    return name


def get(name, device: torch.device):
    """The backend module for ``name`` (see ``resolve``), imported on first use.

    Plain ``import`` statements rather than ``importlib.import_module``: torch.compile (Dynamo) traces an
    import statement but graph-breaks on ``importlib``, and this runs inside every compiled call.
    """
    resolved = resolve(name, device)
    if resolved == "triton":
        from . import triton as module
    else:
        from . import pytorch as module
    return module
