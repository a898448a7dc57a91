"""Silence transformers' progress bars while a GGUF model loads (the SmolLM2 examples and
``fusedce finetune`` show their own progress instead).

``transformers.utils.logging.disable_progress_bar()`` silences the bars transformers makes through its
own ``logging.tqdm`` ("Loading weights"), but not the GGUF dequantization bar: transformers 5.x
(``modeling_gguf_pytorch_utils``) calls ``tqdm.auto.tqdm`` directly, looked up in that module at call
time. ``quiet_gguf_bars`` does both, and swaps that module's ``tqdm`` for a disabled one while the
block runs (restored after). ``bench/real_input.py`` does the same swap to show the bar on its own
rich display instead.
"""
from __future__ import annotations

import contextlib
import functools


@contextlib.contextmanager
def quiet_gguf_bars():
    """Inside the block: transformers logs errors only, and none of its progress bars print (the GGUF
    dequantization bar included). Restores the GGUF module's ``tqdm`` on exit; the logging settings stay."""
    import transformers
    from tqdm.auto import tqdm

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:   # another transformers layout: nothing more to silence
        gguf_utils = None
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None:
        gguf_utils.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
