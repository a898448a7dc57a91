#!/usr/bin/env bash
# make test-compat: the version range the README states, tried in stand-in environments under
# .cache/compat/ (never committed), each built once and reused:
#   py312-torch211  Python 3.12, torch 2.11.0, triton 3.6.0, numpy 2.5.2, transformers 5.17.0: the lent
#                   GPU machine's image (its torch is a ~3.4 GB CUDA build from the registry; it runs on CPU)
#   py311-torch214  Python 3.11, torch 2.14.1, triton 3.8.0: the newest torch this machine's pip takes
#                   (a CUDA build too, from the wheels on this disk)
# In each: `benchmarks/gpu_check.sh --dry-run` (rc 0 and "overall OK") and a representative part of the
# suite (COMPAT_TESTS: torch.compile, autocast, the nn.functional parity, the transformers families, the
# bench peers, the CPU's bf16 GEMM mode). One line per environment goes to .cache/compat/results.txt and
# the exit status is non-zero if any step failed.
#   scripts/test_compat.sh [ENV ...]      (default: both; ~6 GB of downloads the first time, then
#                                          ~10-15 min per environment on the 2-core VM)
# $PYTHON312 / $PYTHON311: the interpreters to build from (default: python3.12 / python3.11 on PATH, then
# pyenv's). A missing interpreter is a failure, said so.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
COMPAT=.cache/compat
TESTS=(${COMPAT_TESTS:-tests/ce/compile/test_compile.py tests/ce/dispatch/test_autocast.py tests/linear/test_nn_functional.py
       tests/hf/test_hf_families.py tests/tools/test_bench_peers.py tests/linear/test_bf16_products.py})
COMMON=(pytest pytest-xdist hypothesis pytest-timeout psutil accelerate peft)
mkdir -p "$COMPAT"

find_python() {   # find_python 3.12 -> a path or nothing
  local v=$1 var="PYTHON${1/./}"
  if [[ -n "${!var:-}" ]]; then echo "${!var}"; return; fi
  command -v "python$v" 2>/dev/null && return
  ls -d /root/.pyenv/versions/"$v".*/bin/python"$v" 2>/dev/null | tail -1
}

pins() {
  case $1 in
    py312-torch211) echo "torch==2.11.0 triton==3.6.0 numpy==2.5.2 transformers==5.17.0" ;;
    py311-torch214) echo "torch==2.14.1 triton==3.8.0 numpy transformers" ;;
    *) return 1 ;;
  esac
}

build() {   # build ENV: the venv with its pins, once (a stamp file marks a finished build)
  local name=$1 v=${1:2:1}.${1:3:2} py venv=$COMPAT/$1
  [[ -f $venv/.built ]] && return 0
  py=$(find_python "$v")
  if [[ -z "$py" ]]; then echo "$name: no python$v found (set \$PYTHON${v/./})"; return 1; fi
  rm -rf "$venv"
  "$py" -m venv "$venv" && "$venv/bin/python" -m pip install -q --upgrade pip \
    && "$venv/bin/python" -m pip install -q $(pins "$name") "${COMMON[@]}" \
    && touch "$venv/.built"
}

check() {   # check ENV: the dry run and the tests; one summary line
  local name=$1 venv=$COMPAT/$1 py dry=FAIL tests rc=0 versions
  py=$ROOT/$venv/bin/python
  versions=$("$py" -c 'import sys, torch, triton, numpy, transformers as t
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
      f"numpy {numpy.__version__}, transformers {t.__version__}")')
  echo "== $name: $versions"
  if PYTHON=$py bash benchmarks/gpu_check.sh --dry-run --out "$venv/gpu_check.json" > "$venv/dry_run.log" 2>&1 \
      && tail -1 "$venv/dry_run.log" | grep -q "overall OK"; then
    dry=OK
  else
    rc=1
  fi
  echo "$name: gpu_check.sh --dry-run $dry ($venv/dry_run.log)"
  TRITON_INTERPRET=1 PYTHONPATH=$ROOT/src "$py" -m pytest -p no:cacheprovider -rfEs "${TESTS[@]}" \
    > "$venv/tests.log" 2>&1 || rc=1
  tests=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|skipped|error)' "$venv/tests.log" | tail -1)
  echo "$name: tests: ${tests:-no summary, see $venv/tests.log}"
  echo "$(date -u +%F) $name [$versions]: dry run $dry; ${TESTS[*]}: ${tests:-?}" >> "$COMPAT/results.txt"
  return $rc
}

status=0
for name in "${@:-py312-torch211 py311-torch214}"; do
  for n in $name; do
    pins "$n" > /dev/null || { echo "unknown environment $n"; status=1; continue; }
    if ! build "$n"; then echo "$n: build FAILED"; status=1; continue; fi
    check "$n" || status=1
  done
done
exit $status
