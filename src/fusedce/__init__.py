"""fusedce: fused cross-entropy kernels for LLM training."""
from .functional import cross_entropy, linear_cross_entropy
from .modules import CrossEntropyLoss, LinearCrossEntropyLoss
from .types import CrossEntropyOutput

__all__ = ["cross_entropy", "linear_cross_entropy", "CrossEntropyLoss", "LinearCrossEntropyLoss",
           "CrossEntropyOutput"]
__version__ = "0.1.0"
