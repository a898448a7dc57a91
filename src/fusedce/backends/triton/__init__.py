"""Triton backend: fused cross-entropy kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""
from .linear import (linear_cross_entropy, linear_token_log_probs, linear_token_log_probs_multi, token_log_probs,
                     token_log_probs_multi)
from .ops import cross_entropy_rows
from .slices import slice_grad, slice_stats
from .soft_ops import soft_cross_entropy_rows
from .tiled import TRITON_TILED

__all__ = ["TRITON_TILED", "cross_entropy_rows", "linear_cross_entropy", "linear_token_log_probs",
           "linear_token_log_probs_multi", "slice_grad", "slice_stats", "soft_cross_entropy_rows", "token_log_probs",
           "token_log_probs_multi"]
