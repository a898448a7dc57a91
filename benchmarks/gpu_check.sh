#!/usr/bin/env bash
# fusedce GPU check for a lent H200 (finishes in < 9 minutes; gpu_check.py prints a short summary table):
#   offline compile report (registers / spills / 128-bit loads, `python -m fusedce.tools.inspect`, ~20 s), then
#   benchmarks/gpu_check.py (~2-3 min, no linear path starts after --deadline-s, default 270 s):
#   cross-entropy parity at LLM shapes, fwd+bwd speed and GB/s vs copy bandwidth, peak memory,
#   CUDA-graph capture of a training step, sync-free hot path, and the LM head fused with the loss
#   (benchmarks/gpu_check_linear.py: stock vs fusedce chunked vs tiled at BT=8192, H=4096, V=128256 and
#   H=2304, V=256000: parity vs float64, time, TFLOP/s, peak memory; log-probs + entropy chunked vs
#   tiled, next to the peers Liger / cut-cross-entropy / quack / torch / TRL where importable, never in
#   the verdict; the TRL SFT head and Liger's RL log-prob + entropy shapes); then the CuTe step (capped at
#   240 s). With .cache/cute/install_cute.sh present (scripts/pack_cute.sh), the CUTLASS DSL and the peers
#   come from it. --out FILE also writes FILE's .md (markdown tables), both rewritten as the run goes.
#
#   benchmarks/gpu_check.sh [--out results/gpu_check.json] [--vocab V ...] [--rows BT] [--no-linear]
#                           [--deadline-s S]
#   benchmarks/gpu_check.sh --dry-run      # CPU, Triton interpreter, small shapes: proves it starts
#
# Python: $PYTHON if set; else .venv/bin/python when it sees a GPU (or for --dry-run); else python3
# (the lent machine's image, which has CUDA torch + Triton). No install needed: src/ goes on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."

dry=0
for arg in "$@"; do [[ "$arg" == "--dry-run" ]] && dry=1; done

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]] && { [[ $dry == 1 ]] || .venv/bin/python -c \
      'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }; then
    PY=.venv/bin/python
  else
    PY=python3
  fi
fi
if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "gpu_check: $PY has no torch. It needs a Python with torch (CUDA build and Triton for the GPU run):" >&2
  echo "  set PYTHON=/path/to/python, or run 'make install' first (.venv/bin/python is then used for" >&2
  echo "  --dry-run, and for the GPU run when it sees a GPU). Without a GPU only --dry-run can run." >&2
  exit 2
fi
if [[ $dry == 0 ]] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: $PY sees no CUDA device: on a machine without a GPU run benchmarks/gpu_check.sh --dry-run" >&2
  exit 2
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# The CUTLASS DSL and the peers (Liger, cut-cross-entropy, quack), carried packed when the image lacks them
# (scripts/pack_cute.sh .cache/cute; carry .cache/cute): sourced before anything runs.
CUTE_PACK="${FUSEDCE_CUTE_PACK:-.cache/cute/install_cute.sh}"
if [[ $dry == 0 && -f "$CUTE_PACK" ]]; then
  . "$CUTE_PACK" || echo "(could not use $CUTE_PACK; continuing without it)"
fi
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"   # Triton 3.9's default, stated

if [[ $dry == 0 ]]; then
  "$PY" - <<'PEERS' || true
import importlib.util as u
print("importable:", ", ".join(f"{m} {'yes' if u.find_spec(m) else 'no'}"
                               for m in ("cutlass", "liger_kernel", "cut_cross_entropy", "quack", "trl")))
PEERS
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
  # Static report of what the kernels compile to for this GPU's arch (no timing; ~20 s). Not fatal:
  # it uses Triton internals that may differ in the machine's Triton version.
  env -u TRITON_INTERPRET "$PY" -m fusedce.tools.inspect --arch 90 --dtype bf16 --variant plain --variant all \
    --vocab 32000 --vocab 128256 --vocab 262144 2>/dev/null || echo "(fusedce inspect failed; continuing)"
fi
rc=0
"$PY" benchmarks/gpu_check.py "$@" || rc=$?
if [[ $dry == 0 ]]; then
  # backend="cute" (CuTe DSL): GPU parity tests + timing next to Triton and stock at BT=8192, V=128256 /
  # 262144 bf16; says SKIPPED when nvidia-cutlass-dsl is not installed (nor carried).
  # $CUTE_TIMEOUT_S (default 240) caps it; $CUTE_OUT is its JSON (default results/gpu_check_cute.json).
  timeout "${CUTE_TIMEOUT_S:-240}" "$PY" benchmarks/gpu_check_cute.py --out "${CUTE_OUT:-results/gpu_check_cute.json}" \
    || echo "(gpu_check_cute failed or timed out: rc $?)"
fi
exit $rc
