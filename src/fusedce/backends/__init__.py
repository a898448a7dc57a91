"""Backend selection: ``resolve`` maps ``backend=`` to a name, ``get`` returns the backend package and checks
that it has what the call needs (``protocol.Capabilities``); the packages: ``docs/internals.md``."""
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
    """Map ``backend=`` (None -> ``$FUSEDCE_BACKEND`` or ``"auto"``; an empty ``$FUSEDCE_BACKEND`` is ``"auto"`` too)
    to a concrete backend name."""
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


def named(name: str):
    """The package of the resolved, checked backend ``name`` (a ``CECall``'s ``backend``): no checks."""
    if name == "triton":
        from . import triton as module
    elif name == "cute":
        from . import cute as module
    else:
        from . import pytorch as module
    return module


def get(name, device: torch.device, *, tiled: bool = False, entropy: bool = False, slices: bool = False,
        distill: bool = False):
    """The backend package for ``name`` (see ``resolve``), imported on first use, checked to have what the call needs:
    ``tiled`` (``method="tiled"``), ``entropy`` (the RL ops), ``slices`` (vocab parallelism), ``distill`` (the
    distillation losses)."""
    resolved = resolve(name, device)
    module = named(resolved)
    caps = module.CAPABILITIES
    missing = [what for what, asked, has in (("method='tiled'", tiled, caps.tiled),
                                             ("entropy / log-prob kernels (the RL ops)", entropy, caps.entropy),
                                             ("vocabulary-slice kernels", slices, caps.slices),
                                             ("distillation kernels", distill, caps.distill)) if asked and not has]
    if missing:
        others = [n for n in ("triton", "torch") if n != resolved]
        raise RuntimeError(f"backend={resolved!r} has no {' and no '.join(missing)} yet; use "
                           + (" or ".join(repr(n) for n in others)) + (" or method='chunked'" if tiled else ""))
    return module
