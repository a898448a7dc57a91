"""Vocab-parallel cross-entropy and RL log-probs / entropy over ``torch.distributed``: each rank holds
a contiguous slice of the vocabulary (logits columns or LM-head rows) and the results equal the
single-process ones on the concatenated vocabulary. Public names are re-exported by
``fusedce.distributed``.

Files: ``layout.py`` (where each rank's slice sits), ``shard_rows.py`` (per-row math of one slice, no
communication), ``exchange.py`` (the forward's two collectives), ``cross_entropy.py`` and ``linear.py``
(autograd Functions and public functions), ``output.py`` (reduction and stats), ``log_probs.py`` and
``linear_log_probs.py`` (the RL ops: ``token_log_probs`` / ``linear_token_log_probs``).
"""
from fusedce.distributed.cross_entropy import vocab_parallel_cross_entropy
from fusedce.distributed.linear import vocab_parallel_linear_cross_entropy
from fusedce.distributed.linear_log_probs import vocab_parallel_linear_token_log_probs
from fusedce.distributed.log_probs import vocab_parallel_token_log_probs

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_linear_cross_entropy",
           "vocab_parallel_linear_token_log_probs", "vocab_parallel_token_log_probs"]
