"""What a patched forward returns, in the stock model's terms: its output class with fields replaced, the
tuple of ``return_dict=False``, and a bad label named as the user's element rather than one of the
shifted, flattened target the loss saw."""
from __future__ import annotations

import dataclasses

import torch


def as_tuple(out) -> tuple:
    """``out.to_tuple()`` (the non-None fields in order), but with ``logits`` kept in its place when it is
    None, so that ``out[1]`` is the logits (None without ``keep_logits``) as in the stock tuple, never
    the field after it (the cache)."""
    if not dataclasses.is_dataclass(out):
        return out.to_tuple()
    return tuple(getattr(out, f.name) for f in dataclasses.fields(out)
                 if getattr(out, f.name) is not None or f.name == "logits")


def bad_label_message(err, shape, given_shifted: bool) -> str:
    """``err`` (at a position of the flattened shifted labels) as the user's ``labels[b, t + 1]``, or
    ``shift_labels[b, t]`` when they were given."""
    index = [int(i) for i in torch.unravel_index(torch.tensor(err.position[0]), tuple(shape))]
    name = "shift_labels" if given_shifted else "labels"
    if not given_shifted:
        index[-1] += 1  # position t predicts labels[t + 1]
    return (f"{name}{index} = {err.value} is out of range: expected ignore_index={err.ignore_index} or a class "
            f"in [0, {err.n_classes}) (the model's vocabulary, V = {err.n_classes})")


def replace(out, **changes):
    """A new output of the same class with ``changes`` (ModelOutput keeps a dict and attributes in sync
    only through its constructor; setting a field to None would leave the dict entry behind)."""
    if dataclasses.is_dataclass(out):
        values = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
        return type(out)(**{**values, **changes})
    for key, value in changes.items():
        out[key] = value
    return out
