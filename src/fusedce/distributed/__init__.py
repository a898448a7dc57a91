"""Vocab-parallel ops over ``torch.distributed``: each rank holds a contiguous slice of the vocabulary (logits
columns or LM-head rows) and the results equal the single-process ones on the concatenated vocabulary."""
from fusedce.core.dtensor import register_vocab_parallel
from fusedce.distributed.cross_entropy import vocab_parallel_cross_entropy
from fusedce.distributed.linear import vocab_parallel_linear_cross_entropy
from fusedce.distributed.linear_log_probs import vocab_parallel_linear_token_log_probs
from fusedce.distributed.log_probs import vocab_parallel_token_log_probs
from fusedce.distributed.topk_distill import (vocab_parallel_linear_topk_distillation_loss,
                                              vocab_parallel_topk_distillation_loss)

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_linear_cross_entropy",
           "vocab_parallel_linear_token_log_probs", "vocab_parallel_token_log_probs",
           "vocab_parallel_topk_distillation_loss", "vocab_parallel_linear_topk_distillation_loss"]

# The public ops' vocabulary-sharded DTensor arguments run these forms (core/dtensor.py). Keys name the public
# ops by module and name (strings: the families need not be imported here).
register_vocab_parallel("fusedce.ce.functional.cross_entropy", vocab_parallel_cross_entropy,
                        {"logits": ("logits_shard", -1), "weight": ("weight_shard", 0)})
register_vocab_parallel("fusedce.ce.functional.linear_cross_entropy", vocab_parallel_linear_cross_entropy,
                        {"weight": ("weight_shard", 0), "bias": ("bias_shard", 0), "ce_weight": ("ce_weight_shard", 0)})
register_vocab_parallel("fusedce.rl.log_probs.token_log_probs", vocab_parallel_token_log_probs,
                        {"logits": ("logits_shard", -1)})
register_vocab_parallel("fusedce.rl.log_probs.linear_token_log_probs", vocab_parallel_linear_token_log_probs,
                        {"weight": ("weight_shard", 0), "bias": ("bias_shard", 0)})
register_vocab_parallel("fusedce.distill.topk.topk_distillation_loss", vocab_parallel_topk_distillation_loss,
                        {"student_logits": ("logits_shard", -1)})
register_vocab_parallel("fusedce.distill.topk.linear_topk_distillation_loss",
                        vocab_parallel_linear_topk_distillation_loss,
                        {"student_weight": ("weight_shard", 0), "student_bias": ("bias_shard", 0)})
