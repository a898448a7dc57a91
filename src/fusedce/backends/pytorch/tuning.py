"""Chunk sizes of the PyTorch backend (one place).

The CPU path processes rows in chunks so that its fp32 temporaries (upcast logits, exp, gradient) hold
about ``CHUNK_ELEMENTS`` values each (64 MiB in fp32) instead of BT x V. Measured on the 2-core x86-64
dev machine at V = 49152, BT = 2048: 85-row chunks (2**22 elements) took 2.0 s for the forward and
2.0 s for the gradient, 512-row chunks 0.95 s and 1.2 s (per-op overheads and thread start-up dominate
small chunks); 2**24 elements (341 rows at that V) is near the fast end at a bounded memory cost.
"""
CHUNK_ELEMENTS = 1 << 24


def chunk_rows(n_classes: int) -> int:
    """Rows per chunk for a vocabulary of ``n_classes``: at least 1."""
    return max(1, CHUNK_ELEMENTS // max(1, n_classes))

# ``method="tiled"`` (``tiled.py``): token x vocabulary blocks of TILE_ROWS x TILE_VOCAB logits (2**20
# values, 4 MiB in fp32 per temporary; a handful live at once). The block must stay far below the
# floor of the loss's memory, the gradients it returns ((V + BT) x H fp32: 123 MiB at BT=4096, H=576,
# V=49152), and large enough that each block's matmul (2 x 512 x 2048 x H FLOPs) outweighs the
# per-block Python and op overheads.
TILE_ROWS = 512
TILE_VOCAB = 2048
