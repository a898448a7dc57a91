"""Backend selection. Each backend package exposes the same small interface:

- ``cross_entropy_rows(logits2d, target1d, weight, opts, inplace_backward, stats)``
  -> ``(ce_row, lse, lse_lo, predicted)``: per-row fp32 cross-entropy WITHOUT the z-loss and per-row
  fp32 lse (both differentiable w.r.t. ``logits2d``; 0 on ignored rows), lse's fp32 rounding error
  (``lse + lse_lo`` exact; no gradient), int64 argmax (-1 on ignored rows); no reduction. The z-loss
  is built from ``lse`` by ``reduction.py``, so its gradient reaches the backend as the upstream
  gradient of ``lse``.
- ``soft_cross_entropy_rows(logits2d, q2d, weight, opts, inplace_backward, stats)``: the same four
  outputs for probability targets ``q2d`` ((BT, V), any float dtype; no row ignored), see
  ``soft_targets.py``; a backend without it (``cute``) refuses them with ``NotImplementedError``.
- ``linear_cross_entropy(..., reduction, scales, ..., method)``: the LM head fused with the loss,
  reduced (``scales`` = the mean's 1/D and 1/N), chunked or tiled, see ``backends/chunk_loop/``.
- ``token_log_probs`` / ``linear_token_log_probs``: per-row log-probs and entropy for RL, see
  ``backends/chunk_loop/log_probs.py``; ``token_log_probs_multi`` / ``linear_token_log_probs_multi``:
  the same for K classes per row (``chunk_loop/log_probs_multi.py``, on the same kernels).
- ``slice_stats`` / ``slice_grad``: the same math on a vocabulary slice (partial row statistics out,
  the slice's gradient from the global statistics in), for ``integrations/distributed``.

Packages: ``pytorch/`` is the backend named ``"torch"`` (the CPU path), ``triton/`` the backend named
``"triton"``, ``cute/`` the backend named ``"cute"`` (CuTe DSL kernels, CUDA only, the optional
``fusedce[cute]`` extra; ``"auto"`` never picks it until verified on a GPU, see ``cute/tuning.py``);
``chunk_loop/`` is not a backend but what they share: the backend-agnostic LM-head chunk loop of
``linear_cross_entropy``, into which each backend plugs its per-chunk cross-entropy.
"""
from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "triton", "cute")


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


PLANNED = ()   # backends the contract names that this version does not have (none now)


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

    ``"auto"``: ``"triton"`` on CUDA tensors, ``"torch"`` otherwise (never ``"cute"``). Raises
    ``ValueError`` for an unknown name, ``RuntimeError`` for ``"triton"`` on CPU tensors without
    ``TRITON_INTERPRET=1`` and for ``"cute"`` without CUDA tensors or without the ``cute`` extra.
    """
    if name is None:
        name = os.environ.get("FUSEDCE_BACKEND") or "auto"   # unset or empty: auto
        try:
            check_name(name)
        except ValueError as exc:   # say where the name came from: no backend= was passed
            raise ValueError(f"$FUSEDCE_BACKEND: {exc} (or unset it for 'auto')") from None
    check_name(name)
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "cute":
        _check_cute(device)   # "auto" never picks it: backends/cute/tuning.py (AUTO_PICKS_CUTE)
    if name == "triton" and device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            "backend='triton' needs CUDA tensors; on CPU it runs only under the Triton interpreter "
            "(set TRITON_INTERPRET=1 before importing triton), which is meant for tests"
        )
    return name


def _check_cute(device: torch.device) -> None:
    """``RuntimeError`` naming what ``backend="cute"`` lacks: CUDA tensors and/or the ``cute`` extra
    (nvidia-cutlass-dsl; looked up without importing it). The CuTe DSL has no CPU emulation."""
    import importlib.util
    missing = []
    if device.type != "cuda":
        missing.append(f"CUDA tensors (got {device.type} tensors; CuTe DSL kernels cannot run on a CPU)")
    if importlib.util.find_spec("cutlass") is None:
        missing.append("the cute extra: pip install 'fusedce[cute]' (nvidia-cutlass-dsl)")
    if missing:
        raise RuntimeError("backend='cute' needs " + " and ".join(missing))


def get(name, device: torch.device):
    """The backend module for ``name`` (see ``resolve``), imported on first use.

    Plain ``import`` statements rather than ``importlib.import_module``: torch.compile (Dynamo) traces an
    import statement but graph-breaks on ``importlib``, and this runs inside every compiled call.
    """
    resolved = resolve(name, device)
    if resolved == "triton":
        from . import triton as module
    elif resolved == "cute":
        from . import cute as module
    else:
        from . import pytorch as module
    return module
