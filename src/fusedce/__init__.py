"""fusedce: fused cross-entropy kernels for LLM training."""
from . import distributed  # noqa: F401  (fusedce.distributed.vocab_parallel_*)
from .distillation_topk import linear_topk_distillation_loss, topk_distillation_loss
from .distillation import distillation_loss, linear_distillation_loss
from .functional import cross_entropy, linear_cross_entropy
from .integrations.hf import patch_causal_lm, unpatch_causal_lm
from .integrations.trl_distill import patch_distillation_trainer, unpatch_distillation_trainer
from .integrations.trl_patch import patch_trl, unpatch_trl
from .log_probs import linear_token_log_probs, token_log_probs
from .modules import CrossEntropyLoss, LinearCrossEntropyLoss
from .types import CrossEntropyOutput, TokenLogProbs, TokenStats

__all__ = ["cross_entropy", "linear_cross_entropy", "token_log_probs", "linear_token_log_probs",
           "CrossEntropyLoss", "LinearCrossEntropyLoss", "CrossEntropyOutput", "TokenLogProbs", "TokenStats",
           "patch_causal_lm", "unpatch_causal_lm", "patch_trl", "unpatch_trl",
           "topk_distillation_loss", "linear_topk_distillation_loss",
           "distillation_loss", "linear_distillation_loss",
           "patch_distillation_trainer", "unpatch_distillation_trainer"]
__version__ = "0.3.0"
