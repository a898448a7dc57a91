"""The loss options, in one place: ``LossOptions`` and the checks of scalar arguments (``schema.py``) and the
helper that writes the options into the public signatures and docstrings (``signatures.py``). Adding a loss
option starts here (README, "Adding a loss option")."""
from fusedce.core.options.schema import (check_accum_dtype, check_chunk_size, check_flag, check_temperature,
                                         deterministic_mode)
from fusedce.core.options.schema import (LOSS_OPTION_NAMES, REDUCTIONS, LossFlags, LossOptions, LossOptionValues,
                                         LossScalars, log_prob_options, loss_options)
from fusedce.core.options.signatures import with_loss_options

__all__ = ["LOSS_OPTION_NAMES", "REDUCTIONS", "LossFlags", "LossOptionValues", "LossOptions", "LossScalars",
           "check_accum_dtype", "check_chunk_size", "check_flag", "check_temperature", "deterministic_mode",
           "log_prob_options", "loss_options", "with_loss_options"]
