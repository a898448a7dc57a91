"""Checks of scalar option values (numbers, integers, flags), shared by the loss options' schema
(``schema.LossOptions``), the public functions' scalar arguments and the tensor checks (``validation``).
Imports nothing of fusedce."""
from __future__ import annotations

import math
import numbers
import operator

import torch

INT32_RANGE = (-2 ** 31, 2 ** 31 - 1)
INT64_RANGE = (-2 ** 63, 2 ** 63 - 1)
FP32_NORMAL = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)   # positive normal fp32
SYMBOLIC = (torch.SymInt, torch.SymFloat)   # Python scalars traced by torch.compile


def finite(value) -> bool:
    """``math.isfinite`` written as comparisons, which torch.compile traces on symbolic floats too."""
    return -math.inf < value < math.inf


def integer_option(name: str, value) -> int:
    """An integer option (``ignore_index``, ``chunk_size``): a Python / NumPy integer or a one-element
    integer tensor (anything ``operator.index`` accepts), never a bool or a float: ``TypeError``."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None


def real_option(name: str, value) -> float:
    """A finite real option (``label_smoothing``, ``lse_square_scale``, ``softcap``): a Python / NumPy
    number or a one-element real tensor. ``TypeError`` for anything else (a string, a bool),
    ``ValueError`` for NaN or an infinity."""
    if isinstance(value, torch.Tensor):
        if torch.compiler.is_compiling():   # its value would be an unbacked symbol that no check can read
            raise TypeError(f"{name}: pass a Python number under torch.compile, not a tensor")
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real number, got a tensor of shape {tuple(value.shape)} "
                            f"and dtype {value.dtype}")
        if value.requires_grad:   # it would silently become a constant
            raise TypeError(f"{name} is a constant of the loss: a tensor that requires grad is not supported")
    elif isinstance(value, bool) or not isinstance(value, (numbers.Real,) + SYMBOLIC):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = value if isinstance(value, SYMBOLIC) else float(value)
    if not finite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def fp32_range(name: str, value: float, lowest: float = 0.0) -> float:
    """``value`` itself when the kernels' fp32 math can hold it: ``ValueError`` when ``|value|`` exceeds
    fp32's largest finite number (it would become inf: NaN rows, e.g. ``inf * 0`` on ignored rows) or
    is non-zero below ``lowest``."""
    if abs(value) > FP32_NORMAL[1] or (value != 0 and abs(value) < lowest):
        bound = (f"0 or have a magnitude in [{lowest:.3g}, {FP32_NORMAL[1]:.3g}]" if lowest else
                 f"at most {FP32_NORMAL[1]:.3g} in magnitude")
        raise ValueError(f"{name} must be {bound} (the fp32 math of the kernels), got {value}")
    return value


def check_flag(name: str, value) -> bool:
    """A boolean option (``return_stats``, ``use_token_scaling``): ``TypeError`` unless a bool (a string
    such as ``"no"`` would otherwise count as True); returns it."""
    if not isinstance(value, bool):
        kind = type(value)
        raise TypeError(f"{name} must be a Python bool, got {value!r} ({kind.__module__}.{kind.__qualname__})")
    return value


def deterministic_mode(deterministic) -> bool:
    """The ``deterministic`` keyword of the linear ops resolved: None follows
    ``torch.are_deterministic_algorithms_enabled()`` (a host flag: no sync; torch.compile guards on it),
    a bool is taken as given; anything else is a ``TypeError``."""
    if deterministic is None:
        return torch.are_deterministic_algorithms_enabled()
    if not isinstance(deterministic, bool):
        kind = type(deterministic)
        raise TypeError(f"deterministic must be None or a Python bool, got {deterministic!r} "
                        f"({kind.__module__}.{kind.__qualname__})")
    return deterministic


def check_temperature(temperature) -> float:
    """The one check of a ``temperature`` (RL log-probs, distillation, top-k distillation): a real number
    (``real_option``: ``TypeError`` for a string or a bool, ``ValueError`` for NaN or an infinity) > 0
    whose inverse is a normal fp32 number, since the kernels multiply by ``1 / temperature``
    (``ValueError``, one message). Returns it as a float."""
    temperature = real_option("temperature", temperature)
    if not temperature > 0.0 or not FP32_NORMAL[0] <= 1.0 / temperature <= FP32_NORMAL[1]:
        raise ValueError(f"temperature must be a finite number > 0 whose inverse is a normal fp32 number (the "
                         f"kernels multiply by 1 / temperature), got {temperature}")
    return temperature


def check_chunk_size(chunk_size) -> None:
    """None or a positive integer (``TypeError`` for a float or a bool, ``ValueError`` for < 1)."""
    if chunk_size is not None and integer_option("chunk_size", chunk_size) < 1:
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size}")


def check_accum_dtype(accum_dtype) -> None:
    """``accum_dtype`` must be a floating-point ``torch.dtype`` (``TypeError``)."""
    if not (isinstance(accum_dtype, torch.dtype) and accum_dtype.is_floating_point):
        raise TypeError(f"accum_dtype must be a floating-point torch.dtype, got {accum_dtype!r}")
