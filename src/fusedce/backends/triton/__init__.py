"""Triton backend: fused cross-entropy kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""
from .linear import linear_cross_entropy
from .ops import cross_entropy_rows
from .slices import slice_grad, slice_stats

__all__ = ["cross_entropy_rows", "linear_cross_entropy", "slice_grad", "slice_stats"]
