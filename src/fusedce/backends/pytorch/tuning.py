"""Chunk sizes of the PyTorch backend (one place)."""
CHUNK_ELEMENTS = 1 << 24


def chunk_rows(n_classes: int) -> int:
    """Rows per chunk for a vocabulary of ``n_classes``: at least 1."""
    return max(1, CHUNK_ELEMENTS // max(1, n_classes))


# CPU row loops: blocks of about 1 MiB of fp32, half a core's L2, one Python thread each (docs/internals.md).
CPU_BLOCK_ELEMENTS = 1 << 18


def cpu_block_rows(n_classes: int) -> int:
    """Rows per block of the CPU row loops for a vocabulary of ``n_classes``: at least 1."""
    return max(1, CPU_BLOCK_ELEMENTS // max(1, n_classes))

# ``method="tiled"``: rows x vocab logits blocks smaller than V (the contract); sizes measured in
# ``benchmarks/README.md`` ("The PyTorch tiled method's block size").
TILE_ROWS = 512
TILE_VOCAB = 256


# ``batch_invariant=True``: block rows a multiple of 64, so ATen's vector loops never split a row into
# vector and scalar code (which round differently; docs/internals.md).
INVARIANT_ROWS = 64


def tile_sizes(n_classes: int, batch_invariant: bool = False) -> tuple:
    """``(rows, vocab)`` of the tiled blocks: ``rows * vocab < n_classes`` whenever ``n_classes >= 2`` (with
    ``batch_invariant``: rows a multiple of ``INVARIANT_ROWS``, and then only when ``n_classes > 64``)."""
    vocab = max(1, min(TILE_VOCAB, n_classes // 2))
    rows = max(1, min(TILE_ROWS, (n_classes - 1) // vocab))
    if batch_invariant:
        rows = INVARIANT_ROWS * max(1, rows // INVARIANT_ROWS)
        vocab = max(1, min(vocab, (n_classes - 1) // rows))
    return rows, vocab
