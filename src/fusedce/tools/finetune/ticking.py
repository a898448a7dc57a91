"""A tqdm bar whose elapsed time keeps moving while one long step runs (tqdm redraws only when it is
updated, so a 60 s step would otherwise leave the bar frozen for 60 s). Used by ``fusedce finetune``
and the SmolLM2 examples."""
from __future__ import annotations

import contextlib
import sys
import threading

REFRESH_SECONDS = 2.0


@contextlib.contextmanager
def ticking(bar, every: float = REFRESH_SECONDS):
    """Redraw ``bar`` (a ``tqdm``) every ``every`` seconds while the block runs, when it draws on a
    terminal; into a log or a pipe nothing extra is written (the bar's own updates only)."""
    stream = getattr(bar, "fp", None) or sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        yield bar
        return
    stop = threading.Event()

    def run():
        while not stop.wait(every):
            bar.refresh()
    thread = threading.Thread(target=run, name="fusedce-progress", daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()
