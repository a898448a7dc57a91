"""CuTe DSL backend (``backend="cute"``): the cross-entropy kernels written in NVIDIA's CuTe DSL
(``pip install fusedce[cute]``, i.e. nvidia-cutlass-dsl), CUDA tensors only.

Same interface and semantics as the Triton backend (``backends/__init__.py``):
- ``cross_entropy_rows``: ``kernels/ce_forward.py`` then, in backward, ``kernels/ce_backward.py``;
- ``CHUNK_CE`` (``linear.CuteChunkCE``) for the chunked LM head (``fusedce.lm_head``): per chunk the fused forward +
  gradient, ``kernels/ce_chunk_onchip.py`` (each row read from HBM once into shared memory, split
  over a thread-block cluster for large V) when ``tuning.onchip_cluster`` allows, else
  ``kernels/ce_chunk.py`` (the row streamed twice, the second read hoped to hit L2);
- ``slice_stats`` / ``slice_grad`` (vocab parallelism): delegated to the Triton backend's kernels
  (same math, CUDA tensors too); no CuTe kernel of their own yet.

Layering: kernels/*.py -> launch.py (compile once, launch into given buffers) -> custom_ops.py
(``fusedce_cute::*`` torch custom ops with fake impls: ``torch.compile(fullgraph=True)`` traces them)
-> cross_entropy.py (autograd) / linear.py (the LM head's ChunkCE).
Importing this package does not import ``cutlass``; the first launch does (``launch.py``).
Status: compiled and statically checked for sm_90a / sm_100a (no spills); numerics not yet verified on
a GPU, so ``backend="auto"`` never picks it (``tuning.AUTO_PICKS_CUTE``).
"""
from ..protocol import Capabilities

NAME = "cute"
# No TiledCE, no entropy, probability-target or distillation kernels yet; vocabulary slices run the Triton backend's
# kernels (slices.py).
CAPABILITIES = Capabilities(tiled=False, entropy=False, slices=True, soft_targets=False, distill=False)
TILED_CE = None
soft_cross_entropy_rows = distill_rows = tiled_distill = None   # not in CAPABILITIES

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
