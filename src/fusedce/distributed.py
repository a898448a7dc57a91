"""Vocab-parallel losses over ``torch.distributed`` (``import fusedce.distributed``).

See :func:`vocab_parallel_cross_entropy` and :func:`vocab_parallel_linear_cross_entropy`
(implementation in ``fusedce/integrations/distributed/``).
"""
from .integrations.distributed import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_linear_cross_entropy"]
