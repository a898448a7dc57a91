"""Fine-tune SmolLM2-135M-Instruct on King James Bible text, stock and through ``fusedce.patch_causal_lm``.

The same as the ``fusedce finetune`` command (``fusedce finetune --help`` lists the options):

    python examples/finetune_smollm2.py                 # 30 steps, batch 4 x 128 tokens, CPU
    python examples/finetune_smollm2.py --steps 10 --batch 2

Writes ``results/finetune.json`` and ``results/finetune.png`` (both loss curves and their difference).
The runner is ``fusedce.tools.finetune.smollm2``; this file only calls it.
"""
import sys

from fusedce.tools.finetune.smollm2 import main

if __name__ == "__main__":
    sys.exit(main())
