"""The LM head fused with the loss, in one place, shared by every backend: the chunked head (``chunked.py``:
logits of one chunk of tokens at a time) and the tiled head (``heads.py``: the backend's ``TiledCE``, no
logits), the method (``method.py``: ``METHODS``, ``resolve_method``, ``make_head``, the chunk size), the
autograd Function (``function.py``), the compaction of ignored rows (``compaction.py``) and the RL
log-probs built on them (``log_probs.py``). A backend plugs in its per-chunk cross-entropy (``ChunkCE``)
and its tiled LM head + loss (``TiledCE``): ``backends/protocol.py``."""
from .function import linear_cross_entropy
from .log_probs import linear_token_log_probs, token_log_probs

__all__ = ["linear_cross_entropy", "linear_token_log_probs", "token_log_probs"]
