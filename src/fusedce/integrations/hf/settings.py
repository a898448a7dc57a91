"""Where a Hugging Face family keeps the settings the patch reads: every config read of the HF patch goes through
here."""
from __future__ import annotations

import math
from typing import Optional

from torch import nn


def model_config(model: nn.Module):
    """``model.config`` (None when it has none)."""
    return getattr(model, "config", None)


def text_config(config):
    """The decoder's text config of ``config`` (``get_text_config(decoder=True)``, where transformers' composite
    configs name it), or ``config`` itself (a text-only config, or one transformers cannot resolve: several text
    sub-configs)."""
    if config is None:
        return None
    getter = getattr(config, "get_text_config", None)
    if not callable(getter):
        return config
    try:
        found = getter(decoder=True)
    except (TypeError, ValueError):   # an older signature, or several candidate sub-configs
        return config
    return config if found is None else found


def text_configs(config) -> tuple:
    """``(text config, top-level config)``, or ``(config,)`` when they are the same object (``()`` for None):
    the order in which a setting is looked up (a wrapper's text config first)."""
    if config is None:
        return ()
    text = text_config(config)
    return (config,) if text is config else (text, config)


def wrapper_setting(model: nn.Module, name: str, default=None):
    """``name`` of the top-level config (a setting of the wrapper itself: ``return_dict``,
    ``is_encoder_decoder``), ``default`` if unset."""
    value = getattr(model_config(model), name, None)
    return default if value is None else value


def text_setting(config, name: str, default=None):
    """``name`` of the text config, else of the top-level config (the first that sets it to a non-None
    value), else ``default``."""
    for source in text_configs(config):
        value = getattr(source, name, None)
        if value is not None:
            return value
    return default


# The names under which a family keeps its MoE load-balancing coefficient on the model instance (its
# ``__init__`` copies it there: Mixtral and most MoE families ``router_aux_loss_coef``; JetMoE
# ``aux_loss_coef``; DBRX ``router_aux_loss_coef`` from ``ffn_config.moe_loss_weight``).
_COEF_ATTRIBUTES = ("router_aux_loss_coef", "aux_loss_coef")


def router_aux_coef(model: nn.Module) -> Optional[float]:
    """The factor the family's forward applies to a returned ``aux_loss``: the model's own attribute, else the text
    config's ``router_aux_loss_coef``, else the top-level config's; None if none is set."""
    value = None
    for name in _COEF_ATTRIBUTES:
        found = model.__dict__.get(name, None)
        if isinstance(found, (int, float)) and not isinstance(found, bool):
            value = found
            break
    if value is None:
        value = text_setting(model_config(model), "router_aux_loss_coef")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{type(model).__name__}: router_aux_loss_coef {value!r} is not a finite number")
    return float(value)
