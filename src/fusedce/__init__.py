"""fusedce: fused cross-entropy kernels for LLM training."""
from fusedce import distributed  # noqa: F401  (fusedce.distributed.vocab_parallel_*)
from fusedce.distill.topk import linear_topk_distillation_loss, topk_distillation_loss
from fusedce.distill.distillation import distillation_loss, linear_distillation_loss
from fusedce.ce.functional import cross_entropy, linear_cross_entropy
from fusedce.integrations.hf.patch import patch_causal_lm, unpatch_causal_lm
from fusedce.integrations.megatron.patch import patch_megatron, unpatch_megatron
from fusedce.integrations.trl.distill import patch_distillation_trainer, unpatch_distillation_trainer
from fusedce.integrations.trl.patch import patch_trl, unpatch_trl
from fusedce.rl.log_probs import linear_token_log_probs, token_log_probs
from fusedce.ce.modules import CrossEntropyLoss, LinearCrossEntropyLoss
from fusedce.core.types import CrossEntropyOutput, TokenLogProbs, TokenStats, TopkDistillationOutput

__all__ = ["cross_entropy", "linear_cross_entropy", "token_log_probs", "linear_token_log_probs",
           "CrossEntropyLoss", "LinearCrossEntropyLoss", "CrossEntropyOutput", "TokenLogProbs", "TokenStats",
           "TopkDistillationOutput",
           "patch_causal_lm", "unpatch_causal_lm", "patch_trl", "unpatch_trl", "patch_megatron", "unpatch_megatron",
           "topk_distillation_loss", "linear_topk_distillation_loss",
           "distillation_loss", "linear_distillation_loss",
           "patch_distillation_trainer", "unpatch_distillation_trainer"]
__version__ = "0.3.0"
