"""The likely mistakes that the shape errors of ``validation.py`` point out: each hint is ``""`` or the
text appended to a ``ValueError`` about the target's shape. Imports nothing of fusedce."""
from __future__ import annotations

import math


def class_dim_hint(logits_shape: tuple, target_shape: tuple) -> str:
    """The hint for a target that fits logits in ``F.cross_entropy``'s layout ``(N, C, d1, ...)`` (classes
    in dimension 1), or ``""``."""
    if len(logits_shape) < 3:
        return ""
    if target_shape != tuple(logits_shape[:1]) + tuple(logits_shape[2:]):
        return ""
    return (f" (logits.shape[:-1]): the class dimension is LAST here, logits (..., V); these logits "
            f"{tuple(logits_shape)} with this target look like F.cross_entropy's layout (N, C, d1, ...) with "
            f"C = {logits_shape[1]} classes in dimension 1: pass logits.movedim(1, -1)")


def swapped_hint(hidden_shape: tuple, weight_shape: tuple, target_shape: tuple) -> str:
    """The hint for ``linear_cross_entropy(weight, hidden, target)`` (the first two swapped), or ``""``:
    ``weight`` has the target's shape but for H, and ``hidden`` is 2-D (a head's ``(V, H)``)."""
    if len(hidden_shape) != 2 or tuple(weight_shape[:-1]) != tuple(target_shape):
        return ""
    return (f" (hidden.shape[:-1]); hidden {hidden_shape} and weight {weight_shape} look swapped: the "
            "arguments are (hidden (..., H), weight (V, H), target (...)), the LM head's weight second")


def reshape_hint(target_shape: tuple, expected_shape: tuple) -> str:
    """The hint for a target holding the right number of tokens in another number of dimensions (a
    flattened ``(B*T,)`` target beside ``(B, T, H)`` hidden states, or the reverse), or ``""``."""
    if len(target_shape) == len(expected_shape) or math.prod(target_shape) != math.prod(expected_shape):
        return ""
    return f" (the same {math.prod(target_shape)} tokens in another shape: pass target.view{expected_shape})"


def shifted_labels_hint(labels_shape: tuple, positions: tuple) -> str:
    """The hint for a patched causal LM given labels shifted already, ``(B, T - 1)`` beside its ``(B, T)``
    positions (the patch shifts them itself, as Hugging Face's loss does), or ``""``."""
    if len(labels_shape) != len(positions) or not positions or tuple(labels_shape[:-1]) != tuple(positions[:-1]) \
            or labels_shape[-1] != positions[-1] - 1:
        return ""
    return (f"labels {tuple(labels_shape)} look shifted already, one shorter than the {tuple(positions)} "
            f"positions: pass the unshifted labels of input_ids' shape {tuple(positions)} (the model shifts "
            "them by one itself, as Hugging Face's loss does: position t predicts labels[t + 1]), or your "
            "shifted ones padded back to that shape as shift_labels=")
