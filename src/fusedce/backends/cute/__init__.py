"""CuTe DSL backend (``backend="cute"``): the cross-entropy kernels written in NVIDIA's CuTe DSL
(``pip install fusedce[cute]``, i.e. nvidia-cutlass-dsl), CUDA tensors only.

Same interface and semantics as the Triton backend (``backends/__init__.py``):
- ``cross_entropy_rows``: ``kernels/ce_forward.py`` then, in backward, ``kernels/ce_backward.py``;
- ``linear_cross_entropy``: the shared chunk loop with ``CuteChunkCE`` (``kernels/ce_chunk.py``: the
  fused forward + gradient of a chunk, read once and written once from HBM);
- ``slice_stats`` / ``slice_grad`` (vocab parallelism): delegated to the Triton backend's kernels
  (same math, CUDA tensors too); no CuTe kernel of their own yet.

Importing this package does not import ``cutlass``; the first launch does (``launch.py``).
Status: compiled and statically checked for sm_90a / sm_100a; numerics not yet verified on a GPU, so
``backend="auto"`` never picks it (``tuning.AUTO_PICKS_CUTE``).
"""
__all__ = ["cross_entropy_rows", "linear_cross_entropy", "slice_grad", "slice_stats"]

_WHERE = {"cross_entropy_rows": "ops", "linear_cross_entropy": "linear", "slice_grad": "slices",
          "slice_stats": "slices"}


def __getattr__(name):
    # Lazy, so that the compile checks (``python -m fusedce.backends.cute.compile``) import only the
    # kernels and not the autograd / chunk-loop layers.
    if name not in _WHERE:
        raise AttributeError(name)
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
