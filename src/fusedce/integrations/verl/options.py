"""The plugin's options, from ``$FUSEDCE_VERL`` (comma-separated ``name=value`` pairs, read when the plugin
activates) or :func:`configure`; every value checked when read (docs/verl.md)."""
from __future__ import annotations

import math
import os

ENV = "FUSEDCE_VERL"
DEFAULTS = {"batch_invariant": False, "logits_dtype": "float32", "method": "auto", "chunk_size": None,
            "backend": None, "top_k": None, "top_p": None}
OPTIONS = dict(DEFAULTS)   # the values every fused call of the plugin uses (process-wide, as the patch)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _check(name: str, value):
    """``value`` of option ``name`` checked and normalized (a string from the environment parsed)."""
    if name == "batch_invariant":
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            value = value.lower() in _TRUE
        if not isinstance(value, bool):
            raise ValueError(f"fusedce.integrations.verl: batch_invariant must be a bool (or 1/0), got {value!r}")
    elif name == "logits_dtype":
        if value not in ("float32", "input"):
            raise ValueError(f"fusedce.integrations.verl: logits_dtype must be 'float32' (fp32 logits, the "
                             f"default) or 'input' (rounded to the hidden states' dtype), got {value!r}")
    elif name == "method":
        if value not in ("auto", "chunked", "tiled"):
            raise ValueError(f"fusedce.integrations.verl: method must be 'auto', 'chunked' or 'tiled', got {value!r}")
    elif name == "backend":
        if value in ("", "none", "None"):
            value = None
        if value not in (None, "auto", "torch", "triton", "cute"):
            raise ValueError(f"fusedce.integrations.verl: backend must be None, 'auto', 'torch', 'triton' or "
                             f"'cute', got {value!r}")
    elif name in ("chunk_size", "top_k"):
        value = _number(name, value, int)
        # verl's rollout config says -1 for "no top-k"; fusedce says 0 / None
        if name == "top_k" and value is not None and value in (-1, 0):
            value = None
        if value is not None and value < 1:
            off = " or -1 / 0 for off, as verl's rollout config" if name == "top_k" else ""
            raise ValueError(f"fusedce.integrations.verl: {name} must be an int >= 1 (or None{off}), got {value!r}")
    elif name == "top_p":
        value = _number(name, value, float)
        if value is not None and not (0.0 < value <= 1.0 and math.isfinite(value)):
            raise ValueError(f"fusedce.integrations.verl: top_p must be a number in (0, 1] (or None), got {value!r}")
        if value == 1.0:
            value = None
    else:
        raise ValueError(f"fusedce.integrations.verl: unknown option {name!r}; the options are "
                         f"{', '.join(DEFAULTS)}")
    return value


def _number(name: str, value, kind):
    if value is None or (isinstance(value, str) and value.lower() in ("", "none")):
        return None
    if isinstance(value, bool):
        raise ValueError(f"fusedce.integrations.verl: {name} must be a number, got {value!r}")
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"fusedce.integrations.verl: {name} must be a number, got {value!r}") from None
    if kind is int and isinstance(value, float) and number != value:
        raise ValueError(f"fusedce.integrations.verl: {name} must be an integer, got {value!r}")
    return number


def parse(text: str) -> dict:
    """The options ``text`` (``$FUSEDCE_VERL``'s form) sets, checked."""
    found = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"${ENV}: {item!r} is not name=value (e.g. {ENV}='batch_invariant=1,top_p=0.9')")
        try:
            found[name.strip()] = _check(name.strip(), value.strip())
        except ValueError as err:   # say where the value came from
            raise ValueError(f"{err} (in ${ENV})") from None
    return found


def _check_together(values: dict, where: str) -> None:
    """``ValueError`` naming ``where`` for options that cannot go together (the op would refuse every call)."""
    truncated = values["top_k"] is not None or values["top_p"] is not None
    if truncated and values["batch_invariant"]:
        raise ValueError(f"{where}: top_k / top_p cannot go with batch_invariant=1 (the truncated log-probs are "
                         "chunked row math without the invariant path); set one of them")
    if truncated and values["method"] == "tiled":
        raise ValueError(f"{where}: top_k / top_p need method 'chunked' or 'auto', got method='tiled'")


def load_env() -> None:
    """``OPTIONS`` = the defaults updated with ``$FUSEDCE_VERL``'s values."""
    values = {**DEFAULTS, **parse(os.environ.get(ENV, ""))}
    _check_together(values, f"${ENV}")
    OPTIONS.clear()
    OPTIONS.update(values)


def configure(**options) -> dict:
    """Set the verl plugin's options for this process; returns them all (docs/verl.md, the options table).

    Args:
        **options: ``batch_invariant``, ``logits_dtype``, ``method``, ``chunk_size``, ``backend``, ``top_k``,
            ``top_p``, as ``$FUSEDCE_VERL`` takes them.

    Raises:
        ValueError: an unknown option, a bad value, or options that cannot go together.
    """
    checked = {name: _check(name, value) for name, value in options.items()}
    _check_together({**OPTIONS, **checked}, "fusedce.integrations.verl.configure")
    OPTIONS.update(checked)
    return dict(OPTIONS)
