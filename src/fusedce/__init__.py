"""fusedce: fused cross-entropy kernels for LLM training."""
from .functional import cross_entropy
from .modules import CrossEntropyLoss
from .types import CrossEntropyOutput

__all__ = ["cross_entropy", "CrossEntropyLoss", "CrossEntropyOutput"]
__version__ = "0.1.0"
