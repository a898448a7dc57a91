"""fusedce: fused cross-entropy kernels for LLM training."""
from . import distributed  # noqa: F401  (fusedce.distributed.vocab_parallel_*)
from .functional import cross_entropy, linear_cross_entropy
from .integrations.hf import patch_causal_lm, unpatch_causal_lm
from .modules import CrossEntropyLoss, LinearCrossEntropyLoss
from .types import CrossEntropyOutput

__all__ = ["cross_entropy", "linear_cross_entropy", "CrossEntropyLoss", "LinearCrossEntropyLoss",
           "CrossEntropyOutput", "patch_causal_lm", "unpatch_causal_lm"]
__version__ = "0.1.0"
