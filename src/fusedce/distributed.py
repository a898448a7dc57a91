"""Vocab-parallel losses and RL log-probs over ``torch.distributed`` (``import fusedce.distributed``).

See :func:`vocab_parallel_cross_entropy`, :func:`vocab_parallel_linear_cross_entropy`,
:func:`vocab_parallel_token_log_probs` and :func:`vocab_parallel_linear_token_log_probs`
(implementation in ``fusedce/integrations/distributed/``).
"""
from .integrations.distributed import (vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy,
                                       vocab_parallel_linear_token_log_probs, vocab_parallel_token_log_probs)

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_linear_cross_entropy",
           "vocab_parallel_linear_token_log_probs", "vocab_parallel_token_log_probs"]
