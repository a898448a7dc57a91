"""fusedce for torchtitan 0.3.0 (the release checked at import; others raise ``ImportError``).

- ``FusedLinearCrossEntropy``: a loss a torchtitan job selects as
  ``loss=FusedLinearCrossEntropy.Config(...)``. A ``ChunkedLossWrapper`` subclass, so the trainer hands it the
  LM head (``set_lm_head``) and the decoder returns the normed hidden states; the loss is fusedce's linear
  cross-entropy from the head's weight (no ``[B, L, V]`` logits, no per-chunk logits beyond fusedce's own
  chunk; the head's forward is not called). See docs/integrations.md (torchtitan).
- ``compute_logprobs``: torchtitan's RL ``compute_logprobs`` from the hidden states and the LM head.

Importing this module changes nothing in torchtitan: it only acts where a job selects it.
"""
from fusedce.integrations.torchtitan.version import SUPPORTED_VERSION, check_version

check_version()

from fusedce.integrations.torchtitan.loss import FusedLinearCrossEntropy  # noqa: E402
from fusedce.integrations.torchtitan.log_probs import compute_logprobs  # noqa: E402

__all__ = ["FusedLinearCrossEntropy", "compute_logprobs", "SUPPORTED_VERSION"]
