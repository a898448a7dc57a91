"""Which model a fused call of verl's belongs to: the wrapped HF forwards (``wrap_forward``) publish the model's
head transform while they run; outside one, ``current()`` is None (the identity, as verl's kernels assume)."""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Optional

from fusedce.integrations.hf.head import LogitTransform, describe, logit_transforms

# The keyword the plugin's engine hook adds to the model's inputs when verl asks for Σπ² (engine.py).
SUM_PI_SQUARED = "fusedce_sum_pi_squared"
_local = threading.local()


@dataclasses.dataclass
class Frame:
    """One running forward: the model's ``transform``, whether to compute ``sum_pi_squared``, and the
    values the fused call left for the forward's output (``results``)."""

    transform: LogitTransform
    sum_pi_squared: bool = False
    results: dict = dataclasses.field(default_factory=dict)


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def push(frame: Frame) -> None:
    """Open ``frame`` (a forward the plugin wraps begins); ``pop`` closes it."""
    _stack().append(frame)


def pop() -> None:
    _stack().pop()


def current() -> Optional[Frame]:
    """The innermost running wrapped forward's frame, or None."""
    stack = _stack()
    return stack[-1] if stack else None


def model_transform(model) -> LogitTransform:
    """``model``'s post-head transform from its config (``hf_head.logit_transforms``); ``ValueError`` when
    its text config and top-level config declare different ones (a multimodal wrapper: the plugin cannot
    tell which one the forward applies)."""
    config = getattr(model, "config", None)
    if config is None:
        return LogitTransform()
    found = logit_transforms(config)
    if len(found) > 1:
        raise ValueError(f"fusedce.integrations.verl: {type(model).__name__}'s text config and top-level config "
                         f"declare different logit transforms ({'; '.join(describe(t) for t in found)}): "
                         "fusedce cannot tell which one its forward applies; turn verl's use_fused_kernels off "
                         "for this model")
    return found[0]


def wrap_forward(original):
    """verl's fused ``forward(self, ...)`` run with this model's ``Frame`` pushed; with the engine's
    ``fusedce_sum_pi_squared=True`` the output gets ``sum_pi_squared`` (the fused call's, same shape as
    ``log_probs``)."""
    if getattr(original, "_fusedce_verl", False):
        return original

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        frame = Frame(model_transform(self), bool(kwargs.pop(SUM_PI_SQUARED, False)))
        stack = _stack()
        stack.append(frame)
        try:
            out = original(self, *args, **kwargs)
        finally:
            stack.pop()
        if frame.sum_pi_squared:
            if "sum_pi_squared" not in frame.results:
                raise RuntimeError("fusedce.integrations.verl: verl asked for sum_pi_squared but the model's fused "
                                   "forward made no fused call through fusedce")
            out.sum_pi_squared = frame.results["sum_pi_squared"]
        return out

    forward._fusedce_verl = True
    return forward
