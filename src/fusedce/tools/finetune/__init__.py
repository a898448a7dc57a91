"""``fusedce finetune``: a real fine-tune, stock vs ``patch_causal_lm`` (``smollm2``: the runner,
``command``: the CLI entry)."""
