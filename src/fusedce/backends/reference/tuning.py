"""Chunk sizes of the PyTorch backend (one place).

The CPU path processes rows in chunks so that its fp32 temporaries (upcast logits, exp, gradient) hold
about ``CHUNK_ELEMENTS`` values each (16 MiB in fp32) instead of BT x V. Chosen on the 2-core x86-64
dev machine: from 2**20 to 2**23 elements the time per row changed by under 5% on V = 49152, and
smaller chunks mean less peak memory, so the low end of the flat region was taken.
"""
CHUNK_ELEMENTS = 1 << 24


def chunk_rows(n_classes: int) -> int:
    """Rows per chunk for a vocabulary of ``n_classes``: at least 1."""
    return max(1, CHUNK_ELEMENTS // max(1, n_classes))
