"""The likely mistakes that argument errors point out: each hint is ``""`` or the text appended to the message."""
from __future__ import annotations

import math
from typing import Optional


def class_dim_hint(logits_shape: tuple, target_shape: tuple) -> str:
    """The hint for logits in ``F.cross_entropy``'s ``(N, C, d1, ...)`` layout or transposed ``(V, BT)``, or ``""``."""
    if len(logits_shape) == 2 and len(target_shape) == 1 and target_shape[0] == logits_shape[1] != logits_shape[0]:
        return (f" (logits.shape[:-1]): the class dimension is LAST, logits (BT, V); these logits "
                f"{tuple(logits_shape)} with a target of {target_shape[0]} tokens look transposed, (V, BT) with "
                f"V = {logits_shape[0]}: pass logits.t()")
    if len(logits_shape) < 3:
        return ""
    if target_shape != tuple(logits_shape[:1]) + tuple(logits_shape[2:]):
        return ""
    return (f" (logits.shape[:-1]): the class dimension is LAST here, logits (..., V); these logits "
            f"{tuple(logits_shape)} with this target look like F.cross_entropy's layout (N, C, d1, ...) with "
            f"C = {logits_shape[1]} classes in dimension 1: pass logits.movedim(1, -1)")


def swapped_hint(hidden_shape: tuple, weight_shape: tuple, target_shape: tuple) -> str:
    """The hint for ``linear_cross_entropy(weight, hidden, target)`` (the first two swapped), or ``""``."""
    if len(hidden_shape) != 2 or tuple(weight_shape[:-1]) != tuple(target_shape):
        return ""
    return (f" (hidden.shape[:-1]); hidden {hidden_shape} and weight {weight_shape} look swapped: the "
            "arguments are (hidden (..., H), weight (V, H), target (...)), the LM head's weight second")


def reshape_hint(target_shape: tuple, expected_shape: tuple) -> str:
    """The hint for a target with the right token count in another number of dimensions, or ``""``."""
    if len(target_shape) == len(expected_shape) or math.prod(target_shape) != math.prod(expected_shape):
        return ""
    return f" (the same {math.prod(target_shape)} tokens in another shape: pass target.view{expected_shape})"


def shifted_labels_hint(labels_shape: tuple, positions: tuple) -> str:
    """The hint for a patched causal LM given labels already shifted, ``(B, T - 1)``, or ``""``."""
    if len(labels_shape) != len(positions) or not positions or tuple(labels_shape[:-1]) != tuple(positions[:-1]) \
            or labels_shape[-1] != positions[-1] - 1:
        return ""
    return (f"labels {tuple(labels_shape)} look shifted already, one shorter than the {tuple(positions)} "
            f"positions: pass the unshifted labels of input_ids' shape {tuple(positions)} (the model shifts "
            "them by one itself, as Hugging Face's loss does: position t predicts labels[t + 1]), or your "
            "shifted ones padded back to that shape as shift_labels=")


def module_hint(name: str, value) -> str:
    """The hint for a module passed where its weight tensor is expected, or ``""``."""
    weight = getattr(value, "weight", None)
    if not callable(value) or weight is None or not hasattr(weight, "shape"):
        return ""
    return f" (a module: pass its weight tensor, e.g. lm_head.weight, as {name})"


def positional_hint(name: str, value, position: str, keyword: str = "ignore_index") -> str:
    """The hint for an integer given positionally where the tensor ``name`` sits (``cross_entropy(logits,
    target, -100)``), or ``""``."""
    if isinstance(value, bool) or not isinstance(value, int):
        return ""
    return (f" ({value} was passed as {name}, the {position} positional argument; for {keyword}, pass "
            f"{keyword}={value} by keyword)")


def distill_swap_hint(student: tuple, student_w: tuple, teacher: tuple, teacher_w: tuple,
                      target: Optional[tuple] = None) -> str:
    """The hint for ``linear_distillation_loss`` with one model's hidden states and head swapped, or ``""``."""
    def looks_swapped(hidden, own_w, other, other_w):
        return len(hidden) == 2 and hidden[0] == other_w[0] and own_w[0] == math.prod(other[:-1])

    names = [name for name, hidden, own_w, other, other_w in (("student", student, student_w, teacher, teacher_w),
                                                              ("teacher", teacher, teacher_w, student, student_w))
             if looks_swapped(hidden, own_w, other, other_w)]
    if len(names) == 2 and target is not None:
        names = [name for name, hidden in (("student", student), ("teacher", teacher))
                 if tuple(hidden[:-1]) != tuple(target)] or names
    order = " the order is (student_hidden, student_weight, teacher_hidden, teacher_weight)"
    if len(names) == 1:
        name = names[0]
        given = student if name == "student" else teacher
        return f"; {name}_hidden {tuple(given)} and {name}_weight look swapped:{order}"
    if len(names) == 2:
        return (f"; the student's or the teacher's hidden states and head look swapped (the shapes cannot "
                f"tell which; a target would):{order}")
    return ""
