"""The backend named ``"torch"``: pure PyTorch, the CPU path (the tests' oracle is the float64 composition
in ``tests/support/reference64.py``). The interface: ``backends/protocol.py`` (``Backend``)."""
from ..protocol import Capabilities
from .cross_entropy import cross_entropy_rows
from .distill import distill_rows
from .custom_ops import tiled_distill
from .custom_ops import TORCH_TILED as TILED_CE
from .custom_ops import slice_grad, slice_stats
from .linear import TorchChunkCE as CHUNK_CE
from .probs_targets import probs_cross_entropy_rows

NAME = "torch"
CAPABILITIES = Capabilities(tiled=True, entropy=True, slices=True, probs_targets=True, distill=True)

__all__ = ["CAPABILITIES", "CHUNK_CE", "NAME", "TILED_CE", "cross_entropy_rows", "distill_rows", "slice_grad",
           "slice_stats", "probs_cross_entropy_rows", "tiled_distill"]
