"""verl 0.9.1's own fused log-prob + entropy kernels (``verl-torch``, ``verl-triton``) as paths of the
RL-precision table, loaded without importing the ``verl`` package where possible (docs/internals.md)."""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from .inputs import IGNORE_INDEX

PATHS = {
    "verl-torch": "verl 0.9.1 FusedLinearForPPO, torch backend (bf16 logits)",
    "verl-triton": "verl 0.9.1 linear_cross_entropy, Triton backend",
}
_loaded: dict = {}


def _verl_dir() -> Path:
    """The installed verl package's folder, found without importing it (``ImportError`` if absent)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:   # absent, or only a namespace folder named verl on the path
        raise ImportError("verl is not installed (make install adds verl 0.9.1 with --no-deps)")
    return Path(spec.origin).parent


def torch_functional():
    """verl's ``utils/experimental/torch_functional.py`` module, loaded from its file (module docstring)."""
    if "torch_functional" not in _loaded:
        path = _verl_dir() / "utils" / "experimental" / "torch_functional.py"
        spec = importlib.util.spec_from_file_location("fusedce_bench_verl_torch_functional", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded["torch_functional"] = module
    return _loaded["torch_functional"]


def forward(name: str, hidden, weight, target):
    """``(log_probs (N,) fp32, entropy (N,) fp32)`` of verl's path ``name``, differentiable."""
    keep = target != IGNORE_INDEX
    labels = target.clamp_min(0)
    if name == "verl-torch":
        lp, ent = torch_functional().FusedLinearForPPOFunction.apply(hidden, weight, labels, 1.0, 512)
    elif name == "verl-triton":
        if not hidden.is_cuda:
            raise ImportError("verl's Triton kernel takes CUDA tensors only (efficient_entropy_forward asserts "
                              "hidden.is_cuda)")
        if hidden.shape[-1] % 128:
            raise ImportError(f"verl's Triton kernel asserts hidden_size % 128 == 0 (here H={hidden.shape[-1]})")
        kernel = importlib.import_module("verl.utils.kernel.linear_cross_entropy")
        lp, ent = kernel.linear_cross_entropy(hidden, weight, labels, 1.0, "none")
    else:
        raise KeyError(name)
    return lp.float().where(keep, 0.0), ent.float().where(keep, 0.0)
