"""Triton backend: fused cross-entropy kernels (CUDA, or CPU under TRITON_INTERPRET=1). The interface:
``backends/protocol.py`` (``Backend``)."""
from ..protocol import Capabilities
from .cross_entropy import cross_entropy_rows
from .distill import distill_rows
from .distill_tiled import tiled_distill
from .linear import TritonChunkCE as CHUNK_CE
from .slices import slice_grad, slice_stats
from .linear import TRITON_TILED as TILED_CE
from .probs_targets import probs_cross_entropy_rows

NAME = "triton"
CAPABILITIES = Capabilities(tiled=True, entropy=True, slices=True, probs_targets=True, distill=True)

__all__ = ["CAPABILITIES", "CHUNK_CE", "NAME", "TILED_CE", "cross_entropy_rows", "distill_rows", "slice_grad",
           "slice_stats", "probs_cross_entropy_rows", "tiled_distill"]
