"""transformers' progress bars while a GGUF model loads: silenced (the SmolLM2 examples and ``fusedce finetune`` show
their own progress) or shown on the bench's rich display."""
from __future__ import annotations

import contextlib
import functools


@contextlib.contextmanager
def gguf_tqdm(replacement):
    """Inside the block transformers' GGUF loader calls ``replacement(iterable, *args, **kwargs)`` where it
    calls ``tqdm``; restored on exit. A transformers without that module or name: nothing is swapped."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:   # another transformers layout: nothing to swap
        gguf_utils = None
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return
    gguf_utils.tqdm = replacement
    try:
        yield
    finally:
        gguf_utils.tqdm = original


@contextlib.contextmanager
def quiet_gguf_bars():
    """Inside the block: transformers logs errors only, and none of its progress bars print (the GGUF
    dequantization bar included). Restores the GGUF module's ``tqdm`` on exit; the logging settings stay."""
    import transformers
    from tqdm.auto import tqdm

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with gguf_tqdm(functools.partial(tqdm, disable=True)):
        yield
