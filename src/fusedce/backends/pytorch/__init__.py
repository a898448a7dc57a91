"""The backend named ``"torch"``: pure PyTorch, the CPU path (the tests' oracle is the float64 composition
in ``tests/reference64.py``)."""
from .custom_ops import slice_grad, slice_stats
from .functions import cross_entropy_rows
from .linear import (linear_cross_entropy, linear_token_log_probs, linear_token_log_probs_multi, token_log_probs,
                     token_log_probs_multi)
from .soft_targets import soft_cross_entropy_rows

__all__ = ["cross_entropy_rows", "linear_cross_entropy", "linear_token_log_probs", "linear_token_log_probs_multi",
           "slice_grad", "slice_stats", "soft_cross_entropy_rows", "token_log_probs", "token_log_probs_multi"]
