"""The loss options ``patch_megatron`` accepts, checked once at patch time: the keyword-only options of
``fusedce.distributed.vocab_parallel_linear_cross_entropy`` except those the patch sets itself (the group,
the per-token ``reduction="none"`` Megatron returns) or that come with each call (``token_weights``)."""
from __future__ import annotations

import inspect

from fusedce import backends
from fusedce.core.options import (LOSS_OPTION_NAMES, check_accum_dtype, check_chunk_size, deterministic_mode,
                                  loss_options)
from fusedce.distributed import vocab_parallel_linear_cross_entropy

_SET_BY_PATCH = ("group", "vocab_start_index", "ce_weight_shard", "reduction", "num_items_in_batch", "return_stats",
                 "token_weights")
LOSS_OPTIONS = tuple(name for name, p in inspect.signature(vocab_parallel_linear_cross_entropy).parameters.items()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in _SET_BY_PATCH)


def validate_options(options: dict) -> dict:
    """``options`` checked (returned as a new dict)."""
    unknown = sorted(set(options) - set(LOSS_OPTIONS))
    if unknown:
        raise TypeError(f"patch_megatron got unknown loss option(s) {unknown}; valid: {list(LOSS_OPTIONS)} "
                        "(the patched model returns Megatron's [b, s] per-token loss: reduce it with the loss_mask "
                        "as Megatron's loss function does; token_weights is a forward keyword)")
    loss_options("none", **{name: value for name, value in options.items() if name in LOSS_OPTION_NAMES})
    check_chunk_size(options.get("chunk_size"))
    if "accum_dtype" in options:
        check_accum_dtype(options["accum_dtype"])
    deterministic_mode(options.get("deterministic"))
    if options.get("backend") is not None:   # the name only: the device is known at the first call
        backends.check_name(options["backend"])
    return dict(options)
