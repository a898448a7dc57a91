"""Section 5 of the GPU check: the LM head fused with the loss, stock vs fusedce chunked vs tiled (Triton).

Run by ``benchmarks/gpu_check.py`` (its rows join the summary table); alone: ``python
benchmarks/gpu_check_linear.py [--dry-run] [--out FILE]`` with ``src`` on ``PYTHONPATH``.

Shapes (bf16, BT = 8192, 25 % of the targets ignored at random): H = 4096, V = 128256 (Llama 3; also
Liger's FLCE benchmark shape), H = 2304, V = 256000 (Gemma 2) and H = 4096, V = 151936 (TRL's SFT head);
the log-prob + entropy op at Liger's RL shape, H = 4096, V = 131072 (``SHAPE_NAMES``). Inputs:
``fusedce.tools.bench.inputs`` source ``"random"`` drawn on the GPU,
hidden ~ N(0, 1), weight ~ N(0, 1) * 0.02 (the memory sweep's data). Paths, each guarded (one failure
does not stop the others):

- ``stock``: the bench's ``linear-torch`` path, ``F.cross_entropy(F.linear(h, W).float(), t)``;
- ``chunked``: ``fusedce.linear_cross_entropy(..., method="chunked", backend="triton")``;
- ``tiled``: the bench's ``linear-fusedce-triton-tiled`` path (``method="tiled"``, backend triton);
- ``tiled-det``: the same with ``deterministic=True`` (the atomic-free backward, 8 instead of 6 V H FLOPs
  per token in backward);
- the peers (``fusedce.tools.bench.peers``), measured the same way but never part of the verdict:
  ``torch-lce``, PyTorch's ``F.linear_cross_entropy(options=LinearCrossEntropyOptions())`` (its CUDA
  chunked path; what its ``"auto"`` resolved to is saved as ``resolved``; ``unavailable`` before torch
  2.13), ``trl``, TRL's ``ChunkedLogProbFunction`` (its Triton kernels), ``liger`` (Liger-Kernel's
  ``LigerFusedLinearCrossEntropyLoss``), ``cce`` (cut-cross-entropy) and ``quack`` (its chunked linear
  cross-entropy, CuTe DSL). A peer that is missing (ImportError / AttributeError) is ``unavailable``, one
  that raises anything else is an ``error``: either way its row says so and the verdict ignores it.

Per path: forward+backward time (``harness.median_ms``: ``triton.testing.do_bench`` median; a path whose
single run takes over ``SLOW_S`` seconds is reported from that one run instead, to keep the budget),
peak memory beyond the inputs (``harness.peak_memory``: gradients included), TFLOP/s of the useful work
6 * N * V * H (N = scored tokens), the full-batch loss next to stock's, and parity against float64 on a
row subset: the path runs on ``PARITY_ROWS`` rows of hidden (spread, ignored ones included) with the full
weight, and ``fusedce.tools.bench.parity.linear_cross_entropy`` compares its mean loss and both gradients
with float64 autograd over chunks of rows. Verdict (C6's rule, with stock as "torch"): gradient error
<= 4x stock's, loss error <= 4x stock's + ``LOSS_SLACK``.

The log-prob + entropy section also times ``stock`` (``F.linear`` in bf16, fp32 ``log_softmax``, the
target's log-prob and ``-sum p log p``), with TFLOP/s of 6 * BT * V * H.

Then at the first shape, if time is left: determinism, ``tiled`` and ``tiled-det`` each run twice
(fwd+bwd) and compared bit for bit (loss, both gradients); ``tiled-det`` must agree exactly, ``tiled``
(fp32 atomics) is reported; then batch invariance (issue 29, ``run_batch_invariance``): the first scored
row's log-prob, entropy and hidden-gradient row in 12 other batches (``rl_precision.PLACEMENTS``) vs the
batch of one, with and without ``batch_invariant=True``; with it no bit may change. After the shapes,
``fusedce.linear_token_log_probs(...,
return_entropy=True)`` at Liger's RL shape (the dry run: at its first shape), chunked vs tiled vs stock
(``F.linear`` in bf16, fp32 ``log_softmax``, the target's log-prob and ``-sum p log p``), backward with
per-token upstreams for both outputs (an advantage on the log-probs, a coefficient on the entropy): time,
TFLOP/s of 6 * BT * V * H, peak memory, log-prob / entropy error against float64 on the subset (next to
torch's own bf16 error, ``parity.linear_token_log_probs``) and how far each method's gradients are from
chunked's; fusedce's methods must also be within ``FP32_LOG_PROB_TOL`` of float64 (fp32 logits).

The peers run last, after fusedce's paths in every shape and the log-probs, so a tight ``deadline`` skips
them first; a peer still running after ``PEER_LIMIT_S`` ends the process (``_PeerWatchdog``). Estimated H200
time (benchmarks/README.md has the whole call's; at ~600 achieved bf16 TFLOP/s; 6 N V H FLOPs chunked and
stock's matmuls, 8 N V H tiled; N = 6144 scored tokens, stock does all 8192): one fwd+bwd ~ 30-50 ms, so
each path's warm-up + peak run + do_bench (~7 runs) + subset parity is ~0.5-1 s plus its library's first
compile (~10-30 s); 3 shapes x (4 fusedce paths + stock + up to 5 peers): ~2-3 min with compiles;
log-probs: ~15 s; float64 references on 2048 rows: ~0.2 s each. A path is not started once ``deadline``
(from ``gpu_check.py``) has passed.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

if __name__ == "__main__" and "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"   # before anything imports triton

import torch  # noqa: E402

import fusedce  # noqa: E402
from fusedce.tools.bench import harness, inputs, parity, peers  # noqa: E402
from fusedce.tools.bench.paths import PATHS  # noqa: E402

IGNORE = inputs.IGNORE_INDEX
# (BT, H, V): Llama 3's head, which is also Liger's FLCE benchmark shape; Gemma 2's; TRL's SFT head (Qwen's
# V = 151936 at H = 4096, 8192 tokens, bf16: TRL's default loss is quoted at 167 ms / 13.1 GiB fwd+bwd on an
# H100, a fused loss at 60-80 ms / ~6 GiB as the target). log_probs: Liger's RL log-prob + entropy shape.
FULL = dict(shapes=((8192, 4096, 128256), (8192, 2304, 256000), (8192, 4096, 151936)), parity_rows=2048,
            log_probs=(8192, 4096, 131072))
SHAPE_NAMES = {(8192, 4096, 128256): "Llama 3 head = Liger FLCE bench", (8192, 2304, 256000): "Gemma 2 head",
               (8192, 4096, 151936): "TRL SFT head", (8192, 4096, 131072): "Liger RL log-prob + entropy"}
# Dry run: V not a multiple of the tiled kernels' 128-class tile, H not one of their 64-wide steps.
DRY = dict(shapes=((32, 96, 1000), (32, 40, 520)), parity_rows=None, log_probs=(32, 96, 1000))
IGNORE_FRACTION, WEIGHT_STD = 0.25, 0.02
SLOW_S = 2.0          # a single fwd+bwd slower than this is not handed to do_bench (~7 more runs)
LOSS_SLACK = 3e-4     # absolute: ~4 sigma of the bf16 rounding of z[target] averaged over 1536 rows
ASSUMED_TFLOPS = 300.0
# nats: fusedce's log-probs / entropy from fp32 logits of bf16 operands vs float64 of the same values (fp32
# sums over H = 4096 products and V = 131072 exponentials: ~1e-5 worst; bf16-rounded logits are ~1e-2 off)
FP32_LOG_PROB_TOL = 1e-4


def interpreter_fixes() -> None:
    """For a dry run (Triton interpreter): the tests' fix of Triton < 3.7's interpreter under numpy >= 2.4
    (a tensor loop bound, ``tests/support/interpreter_index.py``; it does nothing on other versions)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "support"))
    import interpreter_index
    interpreter_index.install()


def _log(msg: str) -> None:
    print(msg, flush=True)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _fused(method: str, **kw):
    def forward(data: inputs.Inputs) -> torch.Tensor:
        return fusedce.linear_cross_entropy(data.hidden, data.weight, data.target, ignore_index=IGNORE,
                                            method=method, backend="triton", **kw)
    return forward


# The registry's ``linear-fusedce-triton`` is method="auto"; the chunked kernels are asked for by name.
PATH_FNS = {"stock": PATHS["linear-torch"].forward, "chunked": _fused("chunked"),
            "tiled": PATHS["linear-fusedce-triton-tiled"].forward,
            "tiled-det": _fused("tiled", deterministic=True),
            "torch-lce": PATHS["linear-torch-lce"].forward, "trl": PATHS["linear-trl"].forward,
            "liger": peers.liger_flce, "cce": peers.cce_linear_cross_entropy,
            "quack": peers.quack_linear_cross_entropy}
# reported, never in the verdict; "extra": a function of the inputs whose result is saved as "resolved"
PEERS = {"torch-lce": dict(extra=PATHS["linear-torch-lce"].extra), "trl": {}, "liger": {}, "cce": {}, "quack": {}}
OWN = [name for name in PATH_FNS if name not in PEERS]
PEER_LIMIT_S = float(os.environ.get("FUSEDCE_GPU_CHECK_PEER_LIMIT_S", "90"))


def run_determinism(data: inputs.Inputs) -> dict:
    """``tiled`` and ``tiled-det`` run twice each: whether loss and gradients agree bit for bit, and the
    largest difference. ``ok``: ``tiled-det`` agrees exactly (``tiled``'s atomics may not)."""
    out = {}
    for name in ("tiled", "tiled-det"):
        runs = []
        for _ in range(2):
            _reset(data.hidden, data.weight)
            loss = PATH_FNS[name](data)
            loss.backward()
            runs.append((loss.detach(), data.hidden.grad, data.weight.grad))
        _reset(data.hidden, data.weight)
        equal = all(torch.equal(a, b) for a, b in zip(*runs))
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(*runs))
        out[name] = dict(bitwise_equal=equal, max_abs_diff=diff)
        _log(f"[determinism] {name:9s} two runs {'bitwise equal' if equal else f'differ (max {diff:.1e})'}")
    out["ok"] = out["tiled-det"]["bitwise_equal"]
    return out


def run_batch_invariance(data: inputs.Inputs) -> dict:
    """Issue 29's guarantee on the device: the first scored row's log-prob, entropy and hidden-gradient
    row in ``rl_precision.PLACEMENTS`` (other batch sizes, positions, chunk sizes, ignored neighbours)
    against the batch of one, with and without ``batch_invariant=True`` (``linear_token_log_probs``, the
    default backend). ``ok``: no placement changes a bit with the flag."""
    from fusedce.tools.bench import rl_precision
    h, w, t = data.hidden.detach(), data.weight.detach(), data.target
    r = int((t != IGNORE).nonzero()[0])
    out = dict(placements=len(rl_precision.PLACEMENTS), row=r,
               changed_default=rl_precision.placements_changed("fusedce", h, w, t, r),
               changed_batch_invariant=rl_precision.placements_changed("fusedce", h, w, t, r, batch_invariant=True))
    out["ok"] = out["changed_batch_invariant"] == 0
    _log(f"[batch invariance] placements changing row {r}: default {out['changed_default']}, batch_invariant "
         f"{out['changed_batch_invariant']} of {out['placements']} -> {'OK' if out['ok'] else 'FAIL'}")
    return out


def _reset(*leaves) -> None:
    for t in leaves:
        t.grad = None


def measure_step(step, leaves, device, dry: bool) -> dict:
    """``ms``, ``peak_bytes``, ``timing`` (how it was timed) and ``last`` (what the peak-memory run of
    ``step``, one fwd+bwd, returned) by the bench's methods: a warm-up run (compiles), then
    ``harness.peak_memory`` of one run, then ``harness.median_ms`` (do_bench median) unless that run took
    over ``SLOW_S``. ``leaves``: the tensors whose ``.grad`` is reset between runs."""
    box = {}
    run = lambda: box.__setitem__("last", step())  # noqa: E731
    reset = lambda: _reset(*leaves)  # noqa: E731
    if dry:   # CPU: one interpreter run, not a measurement; no peak memory
        ms = harness.median_ms(run, reset, "cpu", repeats=1, warmup=0)[0]
        return dict(ms=ms, peak_bytes=None, timing="dry run: 1 interpreter run", last=box["last"])
    run()                                      # compile; the allocator warms up
    reset()
    start = time.perf_counter()
    peak, _method = harness.peak_memory(run, "cuda")   # synchronizes before and after
    single_ms = (time.perf_counter() - start) * 1e3
    last = box["last"]                         # the peak run's outputs (the timed runs overwrite box)
    reset()
    if single_ms > SLOW_S * 1e3:
        return dict(ms=single_ms, peak_bytes=peak, timing="1 run (slow path: no do_bench)", last=last)
    ms, _ = harness.median_ms(run, reset, "cuda", repeats=1, grad_to_none=list(leaves))
    return dict(ms=ms, peak_bytes=peak, timing="do_bench median", last=last)


def _subset_parity(fn, data: inputs.Inputs, rows) -> dict:
    """The path on hidden[rows] with the full weight, against float64 (``parity.linear_cross_entropy``)."""
    sub = inputs.Inputs(target=data.target[rows], hidden=data.hidden.detach()[rows].requires_grad_(True),
                        weight=data.weight)
    data.weight.grad = None
    loss = fn(sub)
    loss.backward()
    out = parity.linear_cross_entropy(sub.hidden, sub.weight, sub.target, loss.detach(),
                                      {"hidden": sub.hidden.grad, "weight": sub.weight.grad}, IGNORE)
    data.weight.grad = None
    return out


def _failure(name: str, exc: BaseException) -> dict:
    """The row of a path that raised. A peer's row is marked ``peer`` (so it never decides the verdict):
    ``unavailable`` when its library or function is missing (ImportError; AttributeError, e.g. torch
    before 2.13 has no ``F.linear_cross_entropy``), else ``error``. A fusedce path's row is an ``error``."""
    if name not in PEERS:
        return dict(error=_error(exc))
    missing = isinstance(exc, (ImportError, AttributeError))
    return dict(peer=True, **{"unavailable" if missing else "error": _error(exc)})


def _why(m: dict) -> str:
    """A row without a measurement, in words: skipped / unavailable (peer) / FAILED / peer failed."""
    if "skipped" in m:
        return m["skipped"]
    if "unavailable" in m:
        return "unavailable: " + m["unavailable"]
    return ("peer failed (not in the verdict): " if m.get("peer") else "FAILED: ") + m.get("error", "?")


def _verdict(par: dict, stock: dict | None) -> bool:
    if stock is None or "grad_rel_err" not in stock:   # no yardstick: the bench smoke test's tolerances
        return par["loss_abs_err"] < 2e-2 and par["grad_rel_err"] < 2e-2
    return (par["grad_rel_err"] <= 4 * stock["grad_rel_err"] + 1e-6
            and par["loss_abs_err"] <= 4 * stock["loss_abs_err"] + LOSS_SLACK)


def _inputs(rows: int, hidden: int, vocab: int, device) -> inputs.Inputs:
    source = {"kind": "random", "tokens": rows, "hidden": hidden, "vocab": vocab, "weight_std": WEIGHT_STD,
              "ignore_fraction": IGNORE_FRACTION, "seed": vocab, "draw": "device"}
    return inputs.build(source, ("hidden", "weight"), torch.bfloat16, str(device))


class _PeerWatchdog:
    """A peer that runs past ``PEER_LIMIT_S`` (the 2026-12-06 H100 run: quack's CuTe linear sat in its JIT
    for 7+ minutes and the whole check was cut) ends this process with a log line, after ``progress()``
    saved what was measured: fusedce's paths run first in every shape (``run``), and gpu_check.sh goes on
    to the CuTe step. A Python-level timeout cannot interrupt a compiler call, hence the exit."""

    def __init__(self, name: str, vocab: int, progress, out: dict):
        self.timer = threading.Timer(PEER_LIMIT_S, self._fire, args=(name, vocab, progress, out))
        self.timer.daemon = True

    @staticmethod
    def _fire(name, vocab, progress, out) -> None:
        out["paths"][name] = dict(error=f"hung: still running after {PEER_LIMIT_S:.0f} s; the process exits "
                                        f"(the peers after it are not measured)")
        _log(f"[linear V={vocab}] {name:8s} still running after {PEER_LIMIT_S:.0f} s: exiting so the rest of "
             f"gpu_check.sh runs")
        try:
            progress()
        finally:
            os._exit(3)

    def __enter__(self):
        self.timer.start()

    def __exit__(self, *exc) -> None:
        self.timer.cancel()


def run_shape(rows: int, hidden: int, vocab: int, device, dry: bool, parity_rows, deadline: float,
              out: dict | None = None, progress=None, names=None) -> dict:
    """The paths ``names`` (default: every one of ``PATH_FNS``) at one shape. ``out``: the dict to fill
    (the caller may save it while it grows; a peer pass adds to the fusedce pass's dict, whose stock row
    it compares with); ``progress()`` is called after each path."""
    names = list(PATH_FNS) if names is None else names
    data = _inputs(rows, hidden, vocab, device)
    scored = int((data.target != IGNORE).sum())
    flops = 6 * scored * vocab * hidden
    _log(f"[linear BT={rows} H={hidden} V={vocab}] {scored} scored tokens; 6NVH = {flops / 1e12:.2f} TFLOP "
         f"(~{flops / ASSUMED_TFLOPS / 1e9:.0f} ms chunked, ~{flops * 4 / 3 / ASSUMED_TFLOPS / 1e9:.0f} ms "
         f"tiled at {ASSUMED_TFLOPS:.0f} TFLOP/s)")
    sub_rows = parity.subset_rows(data.target, parity_rows, IGNORE)
    out = {} if out is None else out
    out.update(rows=rows, hidden=hidden, vocab=vocab, scored_tokens=scored, useful_flops=flops,
               parity_rows=int(sub_rows.shape[0]))
    out.setdefault("paths", {})
    if (rows, hidden, vocab) in SHAPE_NAMES:
        out["name"] = SHAPE_NAMES[rows, hidden, vocab]
    progress = progress or (lambda: None)
    for name in names:
        fn = PATH_FNS[name]
        progress()
        if time.time() > deadline:
            out["paths"][name] = dict(skipped="time budget of gpu_check.py spent")
            _log(f"[linear V={vocab}] {name:8s} SKIPPED (time budget)")
            continue
        try:
            def step():
                loss = fn(data)
                loss.backward()
                return loss.detach()
            with (_PeerWatchdog(name, vocab, progress, out) if name in PEERS and not dry
                  else contextlib.nullcontext()):
                m = measure_step(step, (data.hidden, data.weight), device, dry)
                m["loss"] = float(m.pop("last"))
                m["tflops"] = flops / (m["ms"] * 1e-3) / 1e12
                m["parity"] = _subset_parity(fn, data, sub_rows)
                if PEERS.get(name, {}).get("extra"):
                    m["resolved"] = PEERS[name]["extra"](data)
        except Exception as exc:  # noqa: BLE001 - one failing path must not hide the others
            _reset(data.hidden, data.weight)
            out["paths"][name] = _failure(name, exc)
            _log(f"[linear V={vocab}] {name:8s} {_why(out['paths'][name])}")
            continue
        stock = out["paths"].get("stock", {})
        if "loss" in stock:
            m["loss_diff_vs_stock"] = abs(m["loss"] - stock["loss"])
        m["ok"] = _verdict(m["parity"], stock.get("parity"))
        m["peer"] = name in PEERS
        out["paths"][name] = m
        par = m["parity"]
        _log(f"[linear V={vocab}] {name:8s} {m['ms']:9.2f} ms  {m['tflops']:6.1f} TFLOP/s  "
             f"peak +{_gib(m['peak_bytes'])} GiB  loss {m['loss']:.6f}  vs fp64 on {out['parity_rows']} rows: "
             f"loss {par['loss_abs_err']:.1e}, grad rel {par['grad_rel_err']:.2e} "
             f"(h {par['grads']['hidden']['rel_err']:.1e}, W {par['grads']['weight']['rel_err']:.1e}) "
             f"-> {_mark(m)}  [{m['timing']}]" + (f" resolved {m['resolved']}" if "resolved" in m else ""))
    progress()
    out["data"] = data
    out["sub_rows"] = sub_rows
    return out


def _stock_log_probs(hidden, weight, target):
    """What a user writes without fusedce: ``F.linear`` in bf16, then fp32 ``log_softmax``, the target's
    log-prob and the entropy ``-sum p log p`` (0 on ignored rows)."""
    logp = torch.log_softmax(torch.nn.functional.linear(hidden, weight).float(), dim=-1)
    keep = target != IGNORE
    log_probs = logp.gather(1, target.clamp_min(0)[:, None]).squeeze(1).where(keep, 0.0)
    entropy = (-(logp.exp() * logp).sum(-1)).where(keep, 0.0)
    return log_probs, entropy


def run_log_probs(data: inputs.Inputs, sub_rows, device, dry: bool, deadline: float, progress=None) -> dict:
    """``linear_token_log_probs(return_entropy=True)`` chunked vs tiled, and stock (``_stock_log_probs``),
    per-token upstreams on both outputs. TFLOP/s: 6 * BT * V * H (every row's logits)."""
    flops = 6 * data.target.shape[0] * data.weight.shape[0] * data.weight.shape[1]
    gen = torch.Generator(device=device).manual_seed(7)
    n = data.target.shape[0]
    advantage = torch.randn(n, generator=gen, device=device)
    entropy_coef = torch.randn(n, generator=gen, device=device).mul_(0.01)
    out, first_grads = {}, None
    for method in ("chunked", "tiled", "stock"):
        if progress:
            progress(out)
        if time.time() > deadline:
            out[method] = dict(skipped="time budget of gpu_check.py spent")
            _log(f"[log-probs] {method:8s} SKIPPED (time budget)")
            continue
        try:
            def step():
                if method == "stock":
                    log_probs, entropy = _stock_log_probs(data.hidden, data.weight, data.target)
                else:
                    res = fusedce.linear_token_log_probs(data.hidden, data.weight, data.target, ignore_index=IGNORE,
                                                         return_entropy=True, method=method, backend="triton")
                    log_probs, entropy = res.log_probs, res.entropy
                ((advantage * log_probs).sum() + (entropy_coef * entropy).sum()).backward()
                return log_probs.detach(), entropy.detach()
            m = measure_step(step, (data.hidden, data.weight), device, dry)
            log_probs, entropy = m.pop("last")
            m["tflops"] = flops / (m["ms"] * 1e-3) / 1e12
            m["parity"] = parity.linear_token_log_probs(data.hidden, data.weight, data.target, log_probs, entropy,
                                                        sub_rows, IGNORE)
            data.hidden.grad = data.weight.grad = None
            step()                                   # the gradients, compared between the methods
            grads = (data.hidden.grad.float(), data.weight.grad.float())
            _reset(data.hidden, data.weight)
            if first_grads is None:
                first_grads = grads
            else:
                m["grad_rel_diff_vs_chunked"] = max(
                    float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(grads, first_grads))
        except Exception as exc:  # noqa: BLE001
            _reset(data.hidden, data.weight)
            out[method] = dict(error=_error(exc))
            _log(f"[log-probs] {method:8s} FAILED: {_error(exc)}")
            continue
        par = m["parity"]
        m["ok"] = (par["log_probs_max_abs_err"] <= 4 * par["torch_log_probs_max_abs_err"] + 1e-3
                   and par["entropy_max_abs_err"] <= 4 * par["torch_entropy_max_abs_err"] + 1e-3
                   and m.get("grad_rel_diff_vs_chunked", 0.0) < 2e-2)
        if method != "stock":   # fp32 logits from the bf16 head (issue 29): within fp32 rounding of float64
            m["fp32_logits_ok"] = max(par["log_probs_max_abs_err"], par["entropy_max_abs_err"]) <= FP32_LOG_PROB_TOL
            m["ok"] = m["ok"] and m["fp32_logits_ok"]
        out[method] = m
        diff = m.get("grad_rel_diff_vs_chunked")
        _log(f"[log-probs] {method:8s} {m['ms']:9.2f} ms  peak +{_gib(m['peak_bytes'])} GiB  vs fp64 on "
             f"{par['rows']} rows: log-prob {par['log_probs_max_abs_err']:.1e} (torch bf16 "
             f"{par['torch_log_probs_max_abs_err']:.1e}), entropy {par['entropy_max_abs_err']:.1e} (torch "
             f"{par['torch_entropy_max_abs_err']:.1e})"
             + ("" if diff is None else f", grads vs chunked {diff:.1e}")
             + f" -> {'OK' if m['ok'] else 'FAIL'}  [{m['timing']}]")
    if progress:
        progress(out)
    del first_grads
    return out


def _log_probs_section(result: dict, data, sub_rows, key: str, device, dry: bool, deadline: float, tick) -> None:
    result["log_probs"] = section = dict(shape=key, methods={})
    if tuple(map(int, key.split("x"))) in SHAPE_NAMES:
        section["name"] = SHAPE_NAMES[tuple(map(int, key.split("x")))]
    try:
        run_log_probs(data, sub_rows, device, dry, deadline,
                      lambda methods: (section.__setitem__("methods", methods), tick()))
    except Exception as exc:  # noqa: BLE001
        result["log_probs"] = dict(shape=key, error=_error(exc))


def _mark(m: dict) -> str:
    """OK / FAIL for fusedce's paths; a peer's parity against the same rule is information only."""
    if m.get("peer"):
        return "peer, " + ("within" if m["ok"] else "outside") + " the 4x-stock rule"
    return "OK" if m["ok"] else "FAIL"


def _gib(b) -> str:
    return "n/a" if b is None else f"{b / 2**30:.2f}"


def run(device, dry: bool, deadline: float = float("inf"), progress=None) -> dict:
    """The whole section; every path guarded. ``ok``: no fusedce path failed and every parity verdict
    held (paths skipped for time and the peers do not count). ``progress(result)``, if given, is called
    after every path with the result so far (``gpu_check.py`` saves it: a cut run keeps its rows)."""
    cfg = DRY if dry else FULL
    result = dict(shapes={}, log_probs=None)
    tick = (lambda: progress(result)) if progress else (lambda: None)
    lp_shape = cfg["log_probs"]
    for i, (rows, hidden, vocab) in enumerate(cfg["shapes"]):
        key = f"{rows}x{hidden}x{vocab}"
        if time.time() > deadline:                 # not even the inputs: they take a few seconds
            result["shapes"][key] = dict(paths={name: dict(skipped="time budget of gpu_check.py spent")
                                                for name in PATH_FNS})
            _log(f"[linear {key}] SKIPPED (time budget)")
            continue
        result["shapes"][key] = shape = {}
        try:
            run_shape(rows, hidden, vocab, device, dry, cfg["parity_rows"], deadline, shape, tick, OWN)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory building the inputs
            result["shapes"][key] = dict(error=_error(exc))
            _log(f"[linear {key}] FAILED: {_error(exc)}")
            continue
        data, sub_rows = shape.pop("data"), shape.pop("sub_rows")
        if i == 0 and time.time() < deadline:
            try:
                result["determinism"] = run_determinism(data)
            except Exception as exc:  # noqa: BLE001
                result["determinism"] = dict(error=_error(exc))
        if i == 0 and time.time() < deadline:
            try:
                result["batch_invariance"] = run_batch_invariance(data)
            except Exception as exc:  # noqa: BLE001
                result["batch_invariance"] = dict(error=_error(exc))
        if (rows, hidden, vocab) == lp_shape:      # the dry run: the log-probs reuse this shape's inputs
            _log_probs_section(result, data, sub_rows, key, device, dry, deadline, tick)
        del data
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if result["log_probs"] is None:
        key = "x".join(map(str, lp_shape))
        if time.time() > deadline:
            result["log_probs"] = dict(shape=key, methods={m: dict(skipped="time budget of gpu_check.py spent")
                                                           for m in ("chunked", "tiled", "stock")})
        else:
            try:
                data = _inputs(*lp_shape, device)
                sub_rows = parity.subset_rows(data.target, cfg["parity_rows"], IGNORE)
                _log(f"[log-probs {key}] {SHAPE_NAMES.get(lp_shape, '')}")
                _log_probs_section(result, data, sub_rows, key, device, dry, deadline, tick)
                del data
            except Exception as exc:  # noqa: BLE001
                result["log_probs"] = dict(shape=key, error=_error(exc))
    # The peers last, after every fusedce path and the log-probs: one that hangs costs only the peers after it.
    for rows, hidden, vocab in cfg["shapes"]:
        shape = result["shapes"].get(f"{rows}x{hidden}x{vocab}", {})
        if "paths" not in shape or "stock" not in shape["paths"]:
            continue
        try:
            run_shape(rows, hidden, vocab, device, dry, cfg["parity_rows"], deadline, shape, tick, list(PEERS))
        except Exception as exc:  # noqa: BLE001
            _log(f"[linear {rows}x{hidden}x{vocab}] peers FAILED: {_error(exc)}")
        shape.pop("data", None)
        shape.pop("sub_rows", None)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    tick()
    result["ok"], result["skipped_paths"] = verdict(result)
    return result


def verdict(result: dict) -> tuple[bool, int]:
    """(ok, skipped): ok when every fusedce path, stock, the log-probs methods and the determinism check
    that ran held (a failed shape or log-probs section counts as one failed entry); a peer's row, measured,
    unavailable or raised, never counts. skipped: entries not run for time."""
    measured = []
    for shape in result["shapes"].values():
        measured += [m for m in shape["paths"].values() if not m.get("peer")] if "paths" in shape else [shape]
    lp = result.get("log_probs")
    if lp:
        measured += list(lp["methods"].values()) if "methods" in lp else [lp]
    for check in ("determinism", "batch_invariance"):
        if result.get(check):
            measured.append(result[check])
    return (all(m.get("ok", False) for m in measured if "skipped" not in m),
            sum("skipped" in m for m in measured))


def summary_lines(result: dict) -> list[str]:
    """The section's rows of the summary table."""
    lines = [f"{'linear BTxHxV':>17}  {'path':9s} {'fwd+bwd ms':>10} {'TFLOP/s':>7} {'peak GiB':>8} "
             f"{'|loss-stock|':>12}  parity (fp64 row subset; 6NVH useful FLOPs)"]
    for key, shape in result.get("shapes", {}).items():
        if "error" in shape:
            lines.append(f"{key:>17}  FAILED: {shape['error']}")
            continue
        for name, m in shape["paths"].items():
            if "ms" not in m:
                lines.append(f"{key:>17}  {name:9s} {_why(m)}")
                continue
            par = m["parity"]
            diff = m.get("loss_diff_vs_stock")
            lines.append(f"{key:>17}  {name:9s} {m['ms']:10.2f} {m['tflops']:7.1f} {_gib(m['peak_bytes']):>8} "
                         f"{'' if diff is None else f'{diff:.1e}':>12}  {_mark(m)} "
                         f"(loss {par['loss_abs_err']:.1e}, grad rel {par['grad_rel_err']:.1e})")
    det = result.get("determinism")
    if det:
        lines.append(f"{'determinism':>17}  " + ("FAILED: " + det["error"] if "error" in det else ", ".join(
            f"{name} reruns {'bitwise equal' if det[name]['bitwise_equal'] else 'differ'}"
            for name in ("tiled", "tiled-det"))) + f"  {'OK' if det.get('ok') else 'FAIL'}")
    bi = result.get("batch_invariance")
    if bi:
        lines.append(f"{'batch invariance':>17}  " + ("FAILED: " + bi["error"] if "error" in bi else
                     f"placements changing a row: default {bi['changed_default']}, batch_invariant=True "
                     f"{bi['changed_batch_invariant']} of {bi['placements']}")
                     + f"  {'OK' if bi.get('ok') else 'FAIL'}")
    lp = result.get("log_probs")
    if lp:
        for method, m in lp.get("methods", {"(all)": lp}).items():
            label = f"log-probs+entropy {method}"
            if "ms" not in m:
                lines.append(f"{lp['shape']:>17}  {label}: {m.get('skipped') or 'FAILED: ' + m.get('error', '?')}")
                continue
            lines.append(f"{lp['shape']:>17}  {label}: {m['ms']:.2f} ms, {m['tflops']:.1f} TFLOP/s, "
                         f"peak +{_gib(m['peak_bytes'])} GiB, {'OK' if m['ok'] else 'FAIL'}")
    return lines


def markdown_lines(result: dict) -> list[str]:
    """The section as a markdown table (one row per shape and path, the log-probs methods last); rows
    not measured say why."""
    lines = ["| shape (BTxHxV) | path | fwd+bwd ms | TFLOP/s | peak GiB | parity |", "|---|---|---|---|---|---|"]
    for key, shape in result.get("shapes", {}).items():
        label = f"{key} {shape['name']}" if shape.get("name") else key
        if "error" in shape:
            lines.append(f"| {label} | (all) | | | | FAILED: {shape['error']} |")
            continue
        for name, m in shape.get("paths", {}).items():
            if "ms" not in m:
                lines.append(f"| {label} | {name} | | | | {_why(m)} |")
                continue
            par = m["parity"]
            lines.append(f"| {label} | {name} | {m['ms']:.2f} | {m['tflops']:.1f} | {_gib(m['peak_bytes'])} | "
                         f"{_mark(m)} (loss {par['loss_abs_err']:.1e}, grad rel {par['grad_rel_err']:.1e}) |")
    lp = result.get("log_probs") or {}
    label = f"{lp.get('shape', '')} {lp.get('name', '')}".strip()
    if "error" in lp:
        lines.append(f"| {label} | log-probs+entropy | | | | FAILED: {lp['error']} |")
    for method, m in lp.get("methods", {}).items():
        if "ms" not in m:
            lines.append(f"| {label} | log-probs+entropy {method} | | | | "
                         f"{m.get('skipped') or 'FAILED: ' + m.get('error', '?')} |")
            continue
        par = m["parity"]
        lines.append(f"| {label} | log-probs+entropy {method} | {m['ms']:.2f} | {m['tflops']:.1f} | "
                     f"{_gib(m['peak_bytes'])} | {'OK' if m['ok'] else 'FAIL'} (log-prob "
                     f"{par['log_probs_max_abs_err']:.1e}, entropy {par['entropy_max_abs_err']:.1e}) |")
    return lines


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        _log("no CUDA device: run with --dry-run on CPU")
        return 2
    if args.dry_run:
        interpreter_fixes()
    result = run(torch.device("cpu" if args.dry_run else "cuda"), args.dry_run)
    _log("")
    for line in summary_lines(result):
        _log(line)
    _log(f"linear section: {'OK' if result['ok'] else 'FAIL'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
