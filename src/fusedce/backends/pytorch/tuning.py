"""Chunk sizes of the PyTorch backend (one place)."""
CHUNK_ELEMENTS = 1 << 24


def chunk_rows(n_classes: int) -> int:
    """Rows per chunk for a vocabulary of ``n_classes``: at least 1."""
    return max(1, CHUNK_ELEMENTS // max(1, n_classes))


# On the CPU the row loops (``launch.for_row_blocks``) work instead on blocks of about ``CPU_BLOCK_ELEMENTS``
# values (1 MiB in fp32, half of a core's L2 on the dev VM's Xeon): every pass of a block's math after the
# first reads the cache, not memory, and the fp32 temporaries are cache-sized (a fresh 64 MiB buffer per chunk
# costs page faults, ``launch.Scratch``). The blocks are shared among the intra-op threads as Python threads
# with one intra-op thread each (``launch.run``): no OpenMP barrier per op on these small ops, and each
# row is reduced whole by one thread (the same bits however many rows share a call). The size follows from the
# L2 argument, not from a sweep; the A/B against the former 2**24-element OpenMP chunks is in
# ``benchmarks/README.md`` (equal on an idle machine, faster beside a competing process).
CPU_BLOCK_ELEMENTS = 1 << 18


def cpu_block_rows(n_classes: int) -> int:
    """Rows per block of the CPU row loops for a vocabulary of ``n_classes``: at least 1."""
    return max(1, CPU_BLOCK_ELEMENTS // max(1, n_classes))

# ``method="tiled"`` (``tiled.py``): blocks of rows x vocab logits with rows x vocab < V (the contract: no
# tensor of V or more elements besides the weight, bias, class weights and their gradients), vocab =
# TILE_VOCAB classes (at most half of V) and rows = min(TILE_ROWS, (V - 1) // vocab); 191 x 256 at V = 49152,
# chosen by the measurements in ``benchmarks/README.md`` ("The PyTorch tiled method's block size").
TILE_ROWS = 512
TILE_VOCAB = 256


# ``batch_invariant=True`` (``lm_head/invariant.py``): block rows a multiple of INVARIANT_ROWS. A row's results
# must not depend on where it sits in its block, and ATen's elementwise loops over a contiguous block (exp,
# log, ...) compute the first multiple of 2 x the vector width (32 floats with AVX-512) with vector code and
# the rest with scalar code, whose transcendental functions round differently: measured, a probe row in the
# last row of 9-row blocks (V = 301) changed its bits, in any row of 64-row blocks it did not. With rows a
# multiple of 64 every (rows,) and (rows, vocab) tensor of a block is whole vectors. 128 x 256 at V = 49152.
INVARIANT_ROWS = 64


def tile_sizes(n_classes: int, batch_invariant: bool = False) -> tuple:
    """``(rows, vocab)`` of the tiled method's blocks for a vocabulary of ``n_classes`` (>= 1): ``vocab <
    n_classes`` and ``rows * vocab < n_classes`` whenever ``n_classes >= 2``; with ``batch_invariant``
    rows a multiple of ``INVARIANT_ROWS`` (then ``rows * vocab < n_classes`` needs ``n_classes > 64``)."""
    vocab = max(1, min(TILE_VOCAB, n_classes // 2))
    rows = max(1, min(TILE_ROWS, (n_classes - 1) // vocab))
    if batch_invariant:
        rows = INVARIANT_ROWS * max(1, rows // INVARIANT_ROWS)
        vocab = max(1, min(vocab, (n_classes - 1) // rows))
    return rows, vocab
