"""Pure-PyTorch backend: the CPU path and the tests' oracle besides the float64 composition."""
from .cross_entropy import cross_entropy_rows
from .linear import linear_cross_entropy
from .slices import slice_grad, slice_stats

__all__ = ["cross_entropy_rows", "linear_cross_entropy", "slice_grad", "slice_stats"]
