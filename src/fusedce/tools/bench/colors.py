"""One color per bench path in every panel of ``bench.png`` (the top panels and the memory sweep), and the sentence
that names them all; read by ``report.py`` and ``report_sweep.py``."""
from __future__ import annotations

from .names import STOCK, TORCH_LCE

# (color, legend text, path names); the first group whose names include a path gives its color. The
# legend texts are the paths' names (``names.path_name``) without the backend.
GROUPS = (
    ("tab:gray", STOCK, ("torch", "linear-torch", "distill-stock", "softce-stock", "stock-bf16")),
    ("tab:blue", "fusedce chunked", ("fusedce-torch", "fusedce-triton", "linear-fusedce-torch",
                                     "linear-fusedce-triton", "distill-fusedce-chunked", "softce-fusedce-chunked",
                                     "fusedce", "fusedce-input")),
    ("tab:green", "fusedce tiled", ("linear-fusedce-torch-tiled", "linear-fusedce-triton-tiled",
                                    "distill-fusedce-tiled", "softce-fusedce-tiled")),
    ("tab:orange", TORCH_LCE, ("linear-torch-lce", "softce-torch-chunked", "torch-lce")),
    ("tab:purple", "TRL", ("linear-trl", "distill-trl", "trl-kernel")),
    ("tab:brown", "fp32 head copy", ("fp32-head-copy",)),
)
OTHER = "tab:red"   # a path registered after this table was written


def path_color(path: str) -> str:
    """The matplotlib color of the bench path named ``path`` (``OTHER`` if it has none yet)."""
    return next((color for color, _text, names in GROUPS if path in names), OTHER)


def legend_text(paths=None) -> str:
    """``"gray: stock, blue: fusedce chunked, ..."``: every color and what it stands for; with ``paths`` (the
    path ids a report holds), only the colors of those paths."""
    return ", ".join(f"{color.removeprefix('tab:')}: {text}" for color, text, names in GROUPS
                     if paths is None or any(name in paths for name in names))
