"""The machinery every linear op family shares, for every backend: the chunk loop (``loop.py``), the registry of
loop kinds and its two custom ops (``kinds.py``), the method and the two heads built on it (``head.py``: chunked
and tiled; the headroom of forward-made gradients, the compaction of ignored rows), ``batch_invariant``'s fixed
shapes (``invariant.py``) and fp32 logits from low-precision operands (``fp32_linear.py``); probability targets'
heads in ``probs_loop.py``. A backend plugs in its ``ChunkCE`` and ``TiledCE`` (``backends/protocol.py``).
Design: ``docs/lm_head.md``."""
