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

# ``method="tiled"`` (``tiled.py``): blocks of rows x vocab logits with rows x vocab < V (the contract:
# no tensor of V or more elements besides the weight, bias, class weights and their gradients), vocab =
# TILE_VOCAB classes (at most half of V, so that a block never spans the whole vocabulary) and rows =
# min(TILE_ROWS, (V - 1) // vocab). Measured on the 2-core dev machine, BT=4096, H=576, V=49152, fp32
# fwd+bwd (chunked: 4.4 s): 512 x 2048 blocks (8 V each) 5.7 s; 47 x 1024 (< V) 8.4 s; 23 x 2048 11.3 s;
# 11 x 4096 23.2 s: short blocks are dominated by per-op overheads. Taller, narrower blocks of the same
# size feed the GEMMs better (the weight-gradient GEMM's inner dimension is the block's rows, 47 at
# 1024 wide); per thread, one intra-op thread, the three products of one block took 1.35 ms at 47 x 1024,
# 1.15 at 94 x 512, 1.04 at 188 x 256, 1.02 at 376 x 128; end to end (BT = 1024, same VM, load ~3, fwd+bwd,
# one process per run, two rounds): fp32 2.32-2.34 s at 1024 wide, 2.08 at 512, 1.94-2.11 at 256, 2.22 at 128;
# bf16 2.58 -> 2.03 s at 256. So the vocabulary block is 256 (191 rows at V = 49152).
# The blocks are processed by one Python thread per intra-op thread, each running its ops with one
# intra-op thread (``launch.run``): on the same machine at load ~12, BT=1024, the OpenMP pool took
# 137 s, one thread 20 s, the threads 21 s (chunked: 13 s).
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
