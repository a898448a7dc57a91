"""One GPU check of fusedce (made for a lent H200; < 5 minutes). Run through ``benchmarks/gpu_check.sh``.

A thin driver over ``fusedce.tools.bench``: inputs (``inputs.build``, source ``"random"``: logits ~ N(0, 2^2)
drawn on the GPU, uniform targets, a given fraction ignored), parity (``parity.cross_entropy_rows``),
timing and peak memory (``harness.median_ms`` / ``harness.peak_memory``) and the byte floor
(``paths.ce_floor_bytes``) all live there. Sections, each printed as it finishes; a short summary table
comes last (the JSON of ``--out`` is rewritten after every section, so a killed run still leaves one):

1. copy bandwidth: a device-to-device copy of 2 GiB (bytes read + written / time), the ceiling for GB/s.
2. per vocabulary (BT = 8192 bf16 logits ~ N(0, 2^2), V = 32000 / 128256 / 262144):
   - parity: fusedce's mean loss vs fp32 torch on the whole batch; per-row loss and gradient vs float64
     on a row subset (spread over the batch, ignored rows included: ``parity.subset_rows``); the gradient
     error next to torch's own bf16 error (C6's rule: no worse than 4x).
   - forward+backward time, ``triton.testing.do_bench`` median, for torch eager (``F.cross_entropy`` on
     the fp32-upcast logits, as Hugging Face does), torch.compile of that, fusedce, fusedce with
     ``inplace_backward``, fusedce under torch.compile (its custom ops in Inductor's graph; the eager
     call includes the contract's one host sync, the target range check, the compiled one skips it),
     and the peers Liger and quack if importable (timed only, never in the verdict); GB/s against the fused floor
     3 * BT * V * itemsize (read logits twice, write the gradient once), and the peak memory each
     path allocates beyond its inputs (``torch.cuda.max_memory_allocated``).
3. CUDA graph: a training step (Linear -> fusedce.cross_entropy(return_stats, smoothing, softcap,
   num_items_in_batch) -> backward) is captured once and replayed on new data; loss and weight
   gradient must equal eager.
4. sync-free hot path: ``torch.cuda.set_sync_debug_mode("error")`` around forward+backward with every
   option. The contract allows exactly one host sync, the target range check (it raises IndexError with
   the bad position, so it must read the targets). The check is therefore done in two steps: (a) with the
   range check on, the sync detector must fire (proves the detector is live and that check is the sync);
   (b) with that one check replaced by a no-op, the whole eager public path must run clean. Wrapping only
   the kernels would miss syncs in the validation / reduction / stats glue, and running under
   torch.compile would test Inductor's code instead of ours (the compiled path is covered by
   tests/ce/compile/test_compile.py and by the CUDA-graph section, where the check is skipped by contract).
5. linear cross-entropy (``benchmarks/gpu_check_linear.py``): the LM head fused with the loss at
   BT = 8192, H = 4096, V = 128256 (Llama 3, Liger's FLCE shape), H = 2304, V = 256000 (Gemma 2) and
   H = 4096, V = 151936 (TRL's SFT head) (bf16, 25 % ignored): stock vs fusedce chunked vs tiled
   (Triton) next to the peers (torch, TRL, Liger, cut-cross-entropy, quack: shown, never judged): parity
   vs float64 on a row subset, fwd+bwd time, TFLOP/s, peak memory; and
   ``linear_token_log_probs(return_entropy=True)`` chunked vs tiled vs stock at Liger's RL shape
   (H = 4096, V = 131072). With ``--out FILE`` the JSON and FILE's ``.md`` (markdown tables) are
   rewritten after every path. No path of it starts after
   ``--deadline-s`` seconds (default 270: the CuTe step after this script needs its 4 minutes).

Estimated H200 time: bandwidth ~1 s; per vocabulary ~5-10 s of measurement (parity, 5-6 paths of
do_bench ~0.3 s each) plus torch.compile's compiles (two paths, ~10-30 s the first time, less per new V);
CUDA graph and sync debug ~10 s; linear ~30-60 s. About 2-3 minutes in all.

``--dry-run``: small shapes on CPU with the Triton interpreter, so that the script is known to start
(tests/tools/test_gpu_check_dry_run.py); timings are then not measurements and CUDA-only sections are skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from unittest import mock

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"   # before anything imports triton

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fusedce  # noqa: E402
from fusedce.core import validation  # noqa: E402
from fusedce.tools.bench import inputs, parity  # noqa: E402
from fusedce.tools.bench.paths import ce_floor_bytes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check_linear  # noqa: E402

if "--dry-run" in sys.argv:
    gpu_check_linear.interpreter_fixes()

IGNORE = inputs.IGNORE_INDEX
FULL = dict(rows=8192, vocabs=(32000, 128256, 262144), subset=256)
DRY = dict(rows=32, vocabs=(1000, 4112), subset=8)     # 1000: V % 16 == 8; 4112: two 4096-blocks


def log(msg: str) -> None:
    print(msg, flush=True)


def logits_and_target(rows: int, vocab: int, dtype, device, ignore_fraction: float, seed: int,
                      with_logits: bool = True):
    """(logits or None, target): the bench's ``"random"`` source, logits ~ N(0, 2^2) drawn on ``device``,
    ``round(ignore_fraction * rows)`` targets ignored."""
    source = {"kind": "random", "tokens": rows, "vocab": vocab, "logit_std": inputs.SYNTHETIC_LOGIT_STD,
              "ignore_fraction": ignore_fraction, "seed": seed, "draw": "device"}
    data = inputs.build(source, ("logits",) if with_logits else (), dtype, str(device))
    return (data.logits.detach() if with_logits else None), data.target


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- 1. bandwidth

def copy_bandwidth(device, dry: bool) -> float:
    """GB/s of a device-to-device copy (read + write), the practical ceiling of a streaming kernel."""
    if dry:
        return float("nan")
    import triton

    src = torch.empty(1 << 30, dtype=torch.int16, device=device)     # 2 GiB, well past L2
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------- 2a. parity

def parity_check(logits, target, subset: int, backend: str) -> dict:
    """``parity.cross_entropy_rows`` of fusedce's per-row losses and gradient, and of its mean; OK: mean
    and rows within 2e-5 (relative) and the gradient error no worse than 4x torch's own (C6)."""
    x = logits.clone().requires_grad_()
    rows = fusedce.cross_entropy(x, target, reduction="none", backend=backend)
    rows.sum().backward()
    mean = fusedce.cross_entropy(logits, target, backend=backend)
    par = parity.cross_entropy_rows(logits, target, rows.detach(), x.grad,
                                    parity.subset_rows(target, subset, IGNORE), IGNORE, mean=mean)
    par["ok"] = (par["mean_rel_err_vs_fp32"] < 2e-5 and par["loss_rel_err_vs_fp64"] < 2e-5
                 and par["grad_err_ratio"] <= 4.0)
    return par


# ---------------------------------------------------------------- 2b. speed and memory

def paths(backend: str, dry: bool) -> dict:
    """name -> loss function of (logits, target); every path computes the same mean loss."""
    def torch_eager(x, t):
        return F.cross_entropy(x.float(), t, ignore_index=IGNORE)

    out = {"torch eager": torch_eager}
    if not dry:
        out["torch.compile"] = torch.compile(torch_eager, fullgraph=True, dynamic=False)
    out["fusedce"] = lambda x, t: fusedce.cross_entropy(x, t, backend=backend)
    out["fusedce inplace"] = lambda x, t: fusedce.cross_entropy(x, t, inplace_backward=True, backend=backend)
    if not dry:   # compiled: the custom ops inside Inductor's graph, no range-check sync
        out["fusedce compiled"] = torch.compile(out["fusedce"], fullgraph=True, dynamic=False)
    try:
        from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss
        if not dry:
            out["liger"] = LigerCrossEntropyLoss(ignore_index=IGNORE)
    except Exception:  # noqa: BLE001 - a peer that is missing or fails to import is not timed
        pass
    try:
        from quack.cross_entropy import cross_entropy as quack_cross_entropy
        if not dry:
            out["quack"] = lambda x, t: quack_cross_entropy(x, t, ignore_index=IGNORE)
    except Exception:  # noqa: BLE001
        pass
    return out


def measure(fn, logits, target, device, dry: bool) -> dict:
    """Median fwd+bwd ms and the peak bytes allocated beyond the inputs (``gpu_check_linear.measure_step``:
    ``harness.median_ms`` / ``harness.peak_memory`` after a warm-up). In-place paths overwrite their own
    copy of the logits with gradients, which is fine for timing."""
    x = logits.detach().clone().requires_grad_()
    m = gpu_check_linear.measure_step(lambda: fn(x, target).backward(), (x,), device, dry)
    return dict(ms=m["ms"], peak_bytes=m["peak_bytes"])


# ---------------------------------------------------------------- 3. CUDA graph

def step_loss(model, x, target, backend):
    return fusedce.cross_entropy(model(x), target, label_smoothing=0.1, softcap=30.0,
                                 num_items_in_batch=777, return_stats=True, backend=backend)


def cuda_graph_check(device, dtype, backend: str, dry: bool) -> dict:
    rows, hidden, vocab = (16, 32, 1000) if dry else (2048, 1024, 32000)
    torch.manual_seed(0)
    model = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    _, t = logits_and_target(rows, vocab, dtype, device, 0.1, seed=1, with_logits=False)
    if dry:                                              # no graphs on CPU: run the step once
        step_loss(model, x, t, backend).loss.backward()
        return dict(ok=True, note="dry run: step ran eagerly, nothing captured")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                        # warm-up off the capture stream
        for _ in range(3):
            model.weight.grad = None
            step_loss(model, x, t, backend).loss.backward()
    torch.cuda.current_stream().wait_stream(side)
    model.weight.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step_loss(model, x, t, backend)
        static.loss.backward()
    static_grad = model.weight.grad                      # written by every replay
    worst = 0.0
    for seed in range(2, 5):                             # replay on new data, compare with eager
        new_x = torch.randn(rows, hidden, device=device, dtype=dtype)
        _, new_t = logits_and_target(rows, vocab, dtype, device, 0.1, seed=seed, with_logits=False)
        x.copy_(new_x)
        t.copy_(new_t)
        graph.replay()
        eager = step_loss(model, new_x, new_t, backend)
        (eager_grad,) = torch.autograd.grad(eager.loss, model.weight)
        grad_err = ((static_grad.float() - eager_grad.float()).abs().max()
                    / eager_grad.float().abs().max()).item()
        loss_err = abs(static.loss.item() - eager.loss.item()) / abs(eager.loss.item())
        acc_err = abs(static.token_accuracy.item() - eager.token_accuracy.item())
        worst = max(worst, loss_err, grad_err, acc_err)
    return dict(ok=worst < 1e-2, worst_rel_diff=worst, note="loss, token accuracy, weight grad replayed x3")


# ---------------------------------------------------------------- 4. sync-free hot path

def sync_debug_check(device, dtype, backend: str, dry: bool) -> dict:
    rows, vocab = (16, 1000) if dry else (4096, 32000)
    logits, target = logits_and_target(rows, vocab, dtype, device, 0.1, seed=5)
    weight = torch.rand(vocab, device=device) + 0.5
    n_items = torch.tensor(1234.0, device=device)

    def hot(num_items):
        x = logits.detach().clone().requires_grad_()
        out = fusedce.cross_entropy(x, target, weight, label_smoothing=0.1, lse_square_scale=1e-4,
                                    softcap=30.0, num_items_in_batch=num_items, return_stats=True,
                                    backend=backend)
        out.loss.backward()
        return out

    hot(n_items)                                       # warm-up: kernel compiles are not measured
    no_range_check = mock.patch.object(validation, "check_target_range", lambda *a, **k: None)
    if dry:
        with no_range_check:
            hot(1234)
        return dict(ok=True, note="dry run: no CUDA sync detector on CPU, path ran")
    result = dict(detector_fired_on_range_check=False, clean_with_tensor_items=False,
                  clean_with_int_items=False)
    torch.cuda.set_sync_debug_mode("error")
    try:
        try:
            hot(n_items)
        except RuntimeError as exc:                    # (a) the documented sync is seen
            result["detector_fired_on_range_check"] = "synchroniz" in str(exc).lower()
        with no_range_check:                           # (b) nothing else syncs
            for key, items in (("clean_with_tensor_items", n_items), ("clean_with_int_items", 1234)):
                try:
                    hot(items)
                    result[key] = True
                except RuntimeError as exc:
                    result[key + "_error"] = str(exc).splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    result["ok"] = all(result[k] for k in ("detector_fired_on_range_check", "clean_with_tensor_items",
                                           "clean_with_int_items"))
    return result


# ---------------------------------------------------------------- driver

def _guarded(check, *args) -> dict:
    """Run one check section; an exception is a FAIL with its message, not the end of the script."""
    try:
        return check(*args)
    except Exception as exc:  # noqa: BLE001
        return dict(ok=False, error=f"{type(exc).__name__}: {str(exc)[:500]}")


def _gib(b) -> str:
    return "n/a" if b is None else f"{b / 2**30:.2f}"


def markdown(results: dict) -> list[str]:
    """The results so far as markdown: the cross-entropy table, the checks, the linear section's table."""
    lines = [f"# fusedce GPU check: {results['device']}", "",
             f"torch {results['torch']}, triton {results['triton']}, BT = {results['rows']}, bf16; copy "
             f"{results['copy_gbps']:.0f} GB/s", "",
             "| V | path | fwd+bwd ms | GB/s | peak GiB | parity |", "|---|---|---|---|---|---|"]
    for vocab, v in results["vocabs"].items():
        par = v["parity"]
        for path, m in v["timings"].items():
            if "ms" not in m:
                lines.append(f"| {vocab} | {path} | | | | FAILED: {m.get('error', '?')[:200]} |")
                continue
            verdict = (f"{'OK' if par['ok'] else 'FAIL'} ({par['grad_err_ratio']:.2f}x torch bf16 grad err)"
                       if path == "fusedce" else "")
            lines.append(f"| {vocab} | {path} | {m['ms']:.3f} | {m['gbps']:.0f} | {_gib(m['peak_bytes'])} | "
                         f"{verdict} |")
    for name in ("cuda_graph", "sync_debug"):
        if name in results:
            lines.append(f"\n{name}: {'OK' if results[name]['ok'] else 'FAIL'}")
    if isinstance(results.get("linear"), dict) and "shapes" in results["linear"]:
        lines += ["", "## linear cross-entropy (peers never decide the verdict)", ""]
        lines += gpu_check_linear.markdown_lines(results["linear"])
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="small shapes on CPU (Triton interpreter)")
    p.add_argument("--rows", type=int, help="BT (default 8192; dry run 32)")
    p.add_argument("--vocab", type=int, action="append", help="V, repeatable (default 32000 128256 262144)")
    p.add_argument("--out", help="write all results as JSON here (rewritten after every section)")
    p.add_argument("--deadline-s", type=float, default=270.0,
                   help="no linear-section path starts after this many seconds (default 270)")
    p.add_argument("--no-linear", action="store_true", help="skip section 5 (linear cross-entropy)")
    args = p.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        log("no CUDA device: run with --dry-run on CPU")
        return 2
    cfg = DRY if dry else FULL
    rows, vocabs = args.rows or cfg["rows"], tuple(args.vocab or cfg["vocabs"])
    device = torch.device("cpu" if dry else "cuda")
    dtype, backend = torch.bfloat16, "triton"
    import triton

    name = "CPU (dry run, Triton interpreter: no timing claims)" if dry else torch.cuda.get_device_name()
    log(f"== fusedce GPU check on {name}: torch {torch.__version__}, triton {triton.__version__}, "
        f"BT={rows}, bf16 ==")
    t_start = time.time()
    bw = copy_bandwidth(device, dry)
    log(f"[bandwidth] device-to-device copy: {bw:.0f} GB/s (read + write)")
    results = dict(device=name, torch=torch.__version__, triton=triton.__version__, rows=rows,
                   copy_gbps=bw, vocabs={})

    def save():
        """The JSON of ``--out`` and, beside it, the markdown tables (``.md``), both as far as the run got."""
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=str)
            with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
                f.write("\n".join(markdown(results)) + "\n")

    perf_rows = []
    for vocab in vocabs:
        logits, target = logits_and_target(rows, vocab, dtype, device, 0.0, seed=vocab)
        _, target_par = logits_and_target(rows, vocab, dtype, device, 0.1, seed=vocab, with_logits=False)
        par = parity_check(logits, target_par, cfg["subset"], backend)
        log(f"[parity V={vocab}] mean vs fp32 {par['mean_rel_err_vs_fp32']:.1e}, rows vs fp64 "
            f"{par['loss_rel_err_vs_fp64']:.1e}, grad err {par['grad_err_vs_fp64']:.2e} = "
            f"{par['grad_err_ratio']:.2f}x torch bf16 -> {'OK' if par['ok'] else 'FAIL'}")
        floor = ce_floor_bytes(rows, vocab, logits.element_size())
        timings = {}
        for path, fn in paths(backend, dry).items():
            try:
                m = measure(fn, logits, target, device, dry)
            except Exception as exc:  # noqa: BLE001 - one failing path must not hide the others
                log(f"[speed V={vocab}] {path:16s} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
                timings[path] = dict(error=f"{type(exc).__name__}: {exc}")
                continue
            m["gbps"] = floor / (m["ms"] * 1e-3) / 1e9
            timings[path] = m
            perf_rows.append((vocab, path, m))
            log(f"[speed V={vocab}] {path:16s} {m['ms']:9.3f} ms  {m['gbps']:7.0f} GB/s  "
                f"peak +{_gib(m['peak_bytes'])} GiB")
        results["vocabs"][vocab] = dict(parity=par, timings=timings, floor_bytes=floor)
        save()
        del logits, target, target_par
        if device.type == "cuda":
            torch.cuda.empty_cache()
    log(f"[time] {time.time() - t_start:.0f} s so far")
    graph = _guarded(cuda_graph_check, device, dtype, backend, dry)
    log(f"[cuda graph] {'OK' if graph['ok'] else 'FAIL'}: {graph}")
    sync_res = _guarded(sync_debug_check, device, dtype, backend, dry)
    log(f"[sync debug] {'OK' if sync_res['ok'] else 'FAIL'}: {sync_res}")
    results.update(cuda_graph=graph, sync_debug=sync_res)
    save()
    log(f"[time] {time.time() - t_start:.0f} s so far")
    if args.no_linear:
        linear = dict(ok=True, skipped="--no-linear")
    else:
        def progress(partial):
            results["linear"] = partial
            save()
        linear = _guarded(gpu_check_linear.run, device, dry, t_start + args.deadline_s, progress)
    results.update(linear=linear, seconds=time.time() - t_start)
    save()

    ok = (all(v["parity"]["ok"] for v in results["vocabs"].values()) and graph["ok"] and sync_res["ok"]
          and linear["ok"])
    log("")
    log(f"== summary{' (DRY RUN: times are not measurements)' if dry else ''}: {name}, copy {bw:.0f} GB/s, "
        f"fused floor = 3*BT*V*2 bytes ==")
    log(f"{'V':>7}  {'path':16s} {'fwd+bwd ms':>10} {'GB/s':>7} {'%copy':>6} {'peak GiB':>8}  parity")
    for vocab, path, m in perf_rows:
        par = results["vocabs"][vocab]["parity"]
        verdict = (f"{'OK' if par['ok'] else 'FAIL'} ({par['grad_err_ratio']:.2f}x torch bf16 grad err)"
                   if path == "fusedce" else "")
        log(f"{vocab:>7}  {path:16s} {m['ms']:10.3f} {m['gbps']:7.0f} {100 * m['gbps'] / bw:6.1f} "
            f"{_gib(m['peak_bytes']):>8}  {verdict}")
    if "shapes" in linear:
        for line in gpu_check_linear.summary_lines(linear):
            log(line)
    log(f"CUDA graph capture+replay: {'OK' if graph['ok'] else 'FAIL'}; sync-free hot path: "
        f"{'OK' if sync_res['ok'] else 'FAIL'}; linear (stock/chunked/tiled; peers shown, not judged): "
        f"{linear.get('skipped') or ('OK' if linear['ok'] else 'FAIL: ' + linear.get('error', 'see above'))}"
        f"{f' ({n} skipped for time)' if (n := linear.get('skipped_paths')) else ''}; "
        f"total {results['seconds']:.0f} s; overall {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
