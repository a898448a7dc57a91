"""The machinery every linear op family shares, for every backend: the chunked head (``chunked.py``: logits
of one chunk of tokens at a time) and the tiled head (``heads.py``: the backend's ``TiledCE``, no logits),
the method (``method.py``: ``METHODS``, ``resolve_method``, ``make_head``, the chunk size), the compaction
of ignored rows (``compaction.py``) and the fp16 headroom of forward-made gradients (``headroom.py``). The
families built on it live above: ``ce/linear_function.py`` (the linear cross-entropy's autograd Function),
``rl/linear_head.py`` and ``rl/multi_head.py`` (log-probs), ``distill/linear_head.py`` (distillation). A
backend plugs in its per-chunk cross-entropy (``ChunkCE``) and its tiled LM head + loss (``TiledCE``):
``backends/protocol.py``."""
