"""A loop bound that is a tensor in the Triton interpreter, on Triton < 3.7 with numpy >= 2.4 (tests only).

Under ``TRITON_INTERPRET=1`` a kernel's scalar is a ``tl.tensor`` whose data is a 1-element numpy array,
and ``range(0, n, BLOCK)`` calls its ``__index__``. Triton before 3.7 answers it with
``int(self.handle.data)``; numpy 2.4 turned the conversion of a 1-element array with ``ndim > 0`` to a
Python scalar into ``TypeError: only 0-dimensional arrays can be converted to Python scalars``, so every
kernel with a runtime loop bound (``row_math.py``'s vocabulary scan) fails there. Triton 3.7 squeezes the
array first (``int(self.handle.data.squeeze())``, ``triton/runtime/interpreter.py``); :func:`install`
gives the older interpreter that same ``__index__``. Nothing changes on Triton >= 3.7, numpy < 2.4, or
compiled (GPU) kernels.
"""
from __future__ import annotations

import numpy as np


def _version(text: str) -> tuple[int, int]:
    major, minor = (text.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def needed(triton_version: str, numpy_version: str) -> bool:
    """Whether that Triton's interpreter fails on a 1-element array's ``__index__`` with that numpy."""
    return _version(triton_version) < (3, 7) and _version(numpy_version) >= (2, 4)


def install() -> None:
    """Wrap ``triton.runtime.interpreter._patch_lang_tensor``, where :func:`needed` (no effect without
    Triton; a second call finds the wrapper and does nothing): after the interpreter's own patch of
    ``tl.tensor`` for a launch, ``__index__`` squeezes."""
    try:
        import triton
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes_index", False) or not needed(triton.__version__, np.__version__):
        return

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor
