"""CuTe DSL backend (``backend="cute"``, ``pip install fusedce[cute]``, CUDA tensors only): the Triton
backend's interface in NVIDIA's CuTe DSL; ``"auto"`` never picks it until verified on a GPU (layout and
status: ``docs/internals.md``, "``backends/cute/__init__.py``")."""
from ..protocol import Capabilities

NAME = "cute"
# No TiledCE, no entropy, probability-target or distillation kernels yet; vocabulary slices run the Triton backend's
# kernels (slices.py).
CAPABILITIES = Capabilities(tiled=False, entropy=False, slices=True, probs_targets=False, distill=False)
TILED_CE = None
probs_cross_entropy_rows = distill_rows = tiled_distill = None   # not in CAPABILITIES

__all__ = ["CAPABILITIES", "CHUNK_CE", "NAME", "TILED_CE", "cross_entropy_rows", "slice_grad", "slice_stats"]

_WHERE = {"cross_entropy_rows": "cross_entropy", "CHUNK_CE": "linear", "slice_grad": "slices",
          "slice_stats": "slices"}


def __getattr__(name):
    # Lazy, so that the compile checks (``fusedce.backends.cute.compile``) import only the kernels and
    # not the autograd / custom-op layers.
    if name not in _WHERE:
        raise AttributeError(name)
    import importlib
    module = importlib.import_module(f"{__name__}.{_WHERE[name]}")
    return getattr(module, "CuteChunkCE" if name == "CHUNK_CE" else name)
