"""Fused linear cross-entropy shared by every backend: the chunk loop, the autograd Function and the
compaction of ignored rows. A backend plugs in its per-chunk cross-entropy (``ChunkCE``)."""
from .api import ChunkCE, linear_cross_entropy

__all__ = ["ChunkCE", "linear_cross_entropy"]
