"""The loss options ``patch_causal_lm`` accepts, checked once at patch time against the model's config."""
from __future__ import annotations

import inspect

from torch import nn

from fusedce.backends import BACKENDS
from fusedce.ce.functional import linear_cross_entropy
from fusedce.lm_head import invariant
from fusedce.lm_head.head import check_logits_dtype, check_method
from fusedce.core.options import LOSS_OPTION_NAMES, check_chunk_size, deterministic_mode, loss_options
from fusedce.integrations.hf.head import LogitTransform

# linear_cross_entropy's options a patch may set. num_items_in_batch and token_weights come with each call
# (forward keywords); return_stats would change what `loss` is.
LOSS_OPTIONS = tuple(name for name, p in inspect.signature(linear_cross_entropy).parameters.items()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY
                     and name not in ("num_items_in_batch", "return_stats", "token_weights"))


def validate_options(model: nn.Module, options: dict, transform: LogitTransform) -> dict:
    """The options given to ``patch_causal_lm`` checked at patch time (returned as a new dict)."""
    unknown = sorted(set(options) - set(LOSS_OPTIONS))
    if unknown:
        raise TypeError(f"patch_causal_lm got unknown loss option(s) {unknown}; valid: {list(LOSS_OPTIONS)}")
    softcap = options.get("softcap")
    if transform.softcap is not None and softcap is not None and float(softcap) != transform.softcap:
        raise ValueError(f"softcap={softcap} contradicts {type(model).__name__}'s config "
                         f"final_logit_softcapping={transform.softcap}")
    logit_scale = options.get("logit_scale")
    if transform.scale != 1.0 and logit_scale is not None and float(logit_scale) != transform.scale:
        raise ValueError(f"logit_scale={logit_scale} contradicts {type(model).__name__}'s config (logit scale "
                         f"{transform.scale})")
    loss_options(options.get("reduction", "mean"),
                 **{name: value for name, value in options.items() if name in LOSS_OPTION_NAMES})
    check_chunk_size(options.get("chunk_size"))
    check_method(options.get("method", "auto"), options.get("chunk_size"))
    deterministic_mode(options.get("deterministic"))
    check_logits_dtype(options.get("logits_dtype", "float32"), options.get("method", "auto"))
    invariant.check(options.get("batch_invariant", False))
    backend = options.get("backend")  # the name only: the device is known at the first call
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid names are {BACKENDS}")
    return dict(options)
