"""Vocabulary-parallel slices for ``backend="cute"``: delegated to the Triton backend's kernels (same
math, CUDA tensors); the CuTe backend has no slice kernels of its own yet."""
from ..triton.slices import slice_grad, slice_stats

__all__ = ["slice_grad", "slice_stats"]
