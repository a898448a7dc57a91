"""Vocab-parallel cross-entropy over ``torch.distributed``: each rank holds a contiguous slice of the
vocabulary (logits columns or LM-head rows) and the loss equals the single-process loss on the
concatenated vocabulary. Public names are re-exported by ``fusedce.distributed``.

Files: ``layout.py`` (where each rank's slice sits), ``shard_rows.py`` (per-row math of one slice, no
communication), ``exchange.py`` (the forward's two collectives), ``cross_entropy.py`` and ``linear.py``
(autograd Functions and public functions), ``output.py`` (reduction and stats).
"""
from .cross_entropy import vocab_parallel_cross_entropy
from .linear import vocab_parallel_linear_cross_entropy

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_linear_cross_entropy"]
