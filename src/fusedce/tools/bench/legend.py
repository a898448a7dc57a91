"""The legend printed under every table of ``fusedce bench``: one line per column header saying what the column holds,
in which unit and, for a ratio, which way it points."""
from __future__ import annotations

STATUS = ("ok: measured; error: the measurement failed; unavailable: the path cannot run here (its library "
          "is not installed, or not on this device); a number in brackets: the reason, in the note of that number "
          "below")
RATIO = "{what} of stock / {what} of the path: > 1 means the path {better} than stock ({gain})"
# What a header means wherever it appears; a table adds its specifics (its methods) as ``specific``.
COMMON = {
    "path": "who computes the loss, one name per path in every table and in bench.png (names.py)",
    "dtype": "the inputs' dtype (fp32 = float32, bf16 = bfloat16)",
    "ms": "forward+backward time in milliseconds",
    "MiB": "peak memory beyond the inputs in MiB (2^20 bytes)",
    "status": STATUS,
    "stock/path time": RATIO.format(what="time", better="is faster", gain="a speed-up"),
    "stock/path memory": RATIO.format(what="peak memory", better="needs less memory", gain="a saving"),
    "peak/floor": "peak memory over the floor (the least the loss must hold: its returned gradients)",
}


# The facts some rows add under a table (``extra``: a peer's own check), each explained once under it.
EXTRA = {
    "log_probs_vs_fusedce_max_abs": "max |log p (the peer) - log p (fusedce)| over the scored tokens, nats",
    "trl_log_probs_vs_fp64_max_abs": "max |log p (TRL) - log p (float64)| on the fp64_rows checked rows, nats",
    "fusedce_log_probs_vs_fp64_max_abs": "max |log p (fusedce) - log p (float64)| on the same rows, nats",
    "fp64_rows": "scored rows checked against float64 (a subset: the float64 logits of all would not fit)",
    "scored_rows": "tokens whose target is not ignore_index",
    "acc_policy": "torch LinearCrossEntropyOptions: the accumulation policy 'auto' chose",
    "chunking_method": "torch LinearCrossEntropyOptions: the chunking method 'auto' chose",
    "batch_chunk_size": "torch LinearCrossEntropyOptions: rows per chunk",
    "acc_dtype": "torch LinearCrossEntropyOptions: the accumulators' dtype",
    "error": "the fact could not be read (the exception)",
}


def extra_lines(keys) -> list[str]:
    """``"key: meaning"`` for every fact key in ``keys`` (first appearance order; a key not in ``EXTRA`` is
    listed as unexplained rather than stopping the report)."""
    return [f"{key}: {EXTRA.get(key, '(not explained: add it to legend.EXTRA)')}" for key in dict.fromkeys(keys)]


def header(text: str) -> str:
    """A column header on one line (``"stock/path\\ntime"`` -> ``"stock/path time"``)."""
    return " ".join(text.split())


def lines(headers, specific: dict | None = None) -> list[str]:
    """``"header: meaning"`` for every header (``specific`` first, then ``COMMON``); a header that has no
    meaning is a ``KeyError``, so that no table prints an unexplained column."""
    specific = specific or {}
    out = []
    for text in map(header, headers):
        if text in specific and text in COMMON:
            meaning = f"{COMMON[text]}; {specific[text]}"
        elif text in specific or text in COMMON:
            meaning = specific.get(text) or COMMON[text]
        else:
            raise KeyError(f"bench table column {text!r} has no legend entry")
        out.append(f"{text}: {meaning}")
    return out


def of_table(table) -> list[str]:
    """The headers of a rich ``Table``, on one line each."""
    return [header(str(column.header)) for column in table.columns]
