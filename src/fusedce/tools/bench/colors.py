"""One color per bench path in every panel of ``bench.png`` (the top panels and the memory sweep), and
the sentence that names them all; read by ``report.py`` and ``report_sweep.py``.

Keyed by the path names of ``paths.PATHS`` (the ids in ``bench.json``, ``--paths``); the backend does
not change the color (fusedce's chunked method is blue on the PyTorch and the Triton backend alike).
"""
from __future__ import annotations

# (color, legend text, path names); the first group whose names include a path gives its color
GROUPS = (
    ("tab:gray", "stock PyTorch", ("torch", "linear-torch")),
    ("tab:blue", "fusedce (chunked)", ("fusedce-torch", "fusedce-triton", "linear-fusedce-torch",
                                       "linear-fusedce-triton")),
    ("tab:green", "fusedce tiled", ("linear-fusedce-torch-tiled", "linear-fusedce-triton-tiled")),
    ("tab:orange", "torch F.linear_cross_entropy", ("linear-torch-lce",)),
    ("tab:purple", "TRL ChunkedLogProb", ("linear-trl",)),
)
OTHER = "tab:red"   # a path registered after this table was written


def path_color(path: str) -> str:
    """The matplotlib color of the bench path named ``path`` (``OTHER`` if it has none yet)."""
    return next((color for color, _text, names in GROUPS if path in names), OTHER)


def legend_text() -> str:
    """``"gray: stock PyTorch, blue: fusedce (chunked), ..."``: every color and what it stands for."""
    return ", ".join(f"{color.removeprefix('tab:')}: {text}" for color, text, _names in GROUPS)
