"""Pure-PyTorch backend: the CPU path and the tests' oracle besides the float64 composition."""
from .cross_entropy import cross_entropy_rows

__all__ = ["cross_entropy_rows"]
