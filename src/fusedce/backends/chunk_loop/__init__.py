"""The LM head fused with the loss, shared by every backend: the chunk loop (``method="chunked"``), the
tiled head (``method="tiled"``), the autograd Functions, the compaction of ignored rows, and the RL
log-probs built on them. A backend plugs in its per-chunk cross-entropy (``ChunkCE``) and its tiled
LM head + loss (``TiledCE``), see ``protocols.py``."""
from . import log_probs
from .api import linear_cross_entropy
from .protocols import ChunkCE, TiledCE, TiledRows

__all__ = ["ChunkCE", "TiledCE", "TiledRows", "linear_cross_entropy", "log_probs"]
