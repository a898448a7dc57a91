"""fusedce for torchtitan 0.3.0 (checked at import): ``FusedLinearCrossEntropy``, a loss a job selects as
``loss=FusedLinearCrossEntropy.Config(...)``, and ``compute_logprobs`` for RL (docs/integrations.md,
torchtitan). Importing this module changes nothing in torchtitan."""
from fusedce.integrations.torchtitan.version import SUPPORTED_VERSION, check_version

check_version()

from fusedce.integrations.torchtitan.loss import FusedLinearCrossEntropy  # noqa: E402
from fusedce.integrations.torchtitan.log_probs import compute_logprobs  # noqa: E402

__all__ = ["FusedLinearCrossEntropy", "compute_logprobs", "SUPPORTED_VERSION"]
