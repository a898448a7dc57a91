"""(max value, argmax) of a row packed into one int64, so that ``all_reduce(MAX)`` over ranks yields the global max and
the LOWEST global index among ties in a single collective (8 bytes per row)."""
from __future__ import annotations

import torch

_LOW = 1 << 32
_MAGNITUDE = 0x7FFFFFFF
EMPTY_KEY = torch.iinfo(torch.int64).min  # a rank holding no classes: loses to every real key


def pack_max_key(value: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``value`` (n,) fp32 row maxima, ``index`` (n,) int64 global class ids in [0, 2**32) -> (n,) int64."""
    value = torch.where(value == 0, torch.zeros_like(value), value)  # -0.0 -> +0.0
    bits = value.view(torch.int32).to(torch.int64)                   # sign-extended
    ordered = torch.where(bits >= 0, bits, bits ^ _MAGNITUDE)
    return ordered * _LOW + (_LOW - 1 - index)


def unpack_max_key(key: torch.Tensor):
    """Inverse of ``pack_max_key``: ``(value (n,) fp32, index (n,) int64)``."""
    ordered = torch.div(key, _LOW, rounding_mode="floor")
    index = _LOW - 1 - (key - ordered * _LOW)
    bits = torch.where(ordered >= 0, ordered, ordered ^ _MAGNITUDE)
    return bits.to(torch.int32).view(torch.float32), index
