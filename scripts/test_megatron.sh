#!/usr/bin/env bash
# make test-megatron: tests/megatron (fusedce.patch_megatron, 2 gloo ranks on CPU) on the megatron-core
# releases that need Python 3.12 (0.17 and later), in a stand-in environment under .cache/megatron312/
# (never committed), built once and reused: Python 3.12, torch 2.11.0 (a ~3.4 GB CUDA build from the
# registry; it runs on CPU), triton 3.6.0, megatron-core 0.19.2 installed with --no-deps (it imports torch,
# numpy and packaging on the paths the tests use), and 0.17.0 / 0.18.0 each in its own --target folder put
# first on PYTHONPATH for its run. 0.16.1 is tested in the main suite (`make test`, Python 3.11).
#   scripts/test_megatron.sh [RELEASE ...]     (default: 0.19.2 0.18.0 0.17.0; ~1-2 min per release on the
#                                               2-core VM once built; the first build ~5-10 min)
# $PYTHON312: the interpreter to build from (default: python3.12 on PATH, then pyenv's 3.12).
# One line per release goes to .cache/megatron312/results.txt; the exit status is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ENV=.cache/megatron312
NEWEST=0.19.2
RELEASES=(${@:-0.19.2 0.18.0 0.17.0})

py312() {
  if [[ -n "${PYTHON312:-}" ]]; then echo "$PYTHON312"; return; fi
  command -v python3.12 2>/dev/null && return
  ls -d /root/.pyenv/versions/3.12.*/bin/python3.12 2>/dev/null | tail -1
}

build() {   # the venv, once (a stamp file marks a finished build)
  [[ -f $ENV/.built ]] && return 0
  local py
  py=$(py312)
  if [[ -z "$py" ]]; then echo "no python3.12 found (set \$PYTHON312)"; return 1; fi
  rm -rf "$ENV"
  "$py" -m venv "$ENV" && "$ENV/bin/python" -m pip install -q --upgrade pip \
    && "$ENV/bin/python" -m pip install -q torch==2.11.0 triton==3.6.0 numpy 'packaging>=24.2' pytest \
         pytest-timeout hypothesis psutil \
    && "$ENV/bin/python" -m pip install -q --no-deps "megatron-core==$NEWEST" \
    && touch "$ENV/.built"
}

release_path() {   # release_path X.Y.Z -> the PYTHONPATH entry that makes it the imported megatron-core
  local v=$1
  [[ $v == "$NEWEST" ]] && return 0
  if [[ ! -f $ENV/mcore-$v/.built ]]; then
    rm -rf "$ENV/mcore-$v"
    "$ENV/bin/python" -m pip install -q --no-deps --target "$ENV/mcore-$v" "megatron-core==$v" \
      && touch "$ENV/mcore-$v/.built" || return 1
  fi
  echo "$ROOT/$ENV/mcore-$v"
}

build || { echo "megatron312: build FAILED"; exit 1; }
status=0
for v in "${RELEASES[@]}"; do
  extra=$(release_path "$v") || { echo "megatron-core $v: install FAILED"; status=1; continue; }
  found=$(PYTHONPATH=$extra "$ENV/bin/python" -c 'from megatron.core import package_info; print(package_info.__version__)' 2>/dev/null)
  # (0.18+ append the git commit of the working directory to their version: "0.18.0+f2a9b57")
  if [[ "${found%%+*}" != "$v" ]]; then echo "megatron-core $v: imported $found instead"; status=1; continue; fi
  log=$ENV/tests-$v.log
  TRITON_INTERPRET=1 PYTHONPATH=$extra "$ENV/bin/python" -m pytest -p no:cacheprovider -rfEs --timeout 900 \
    tests/megatron > "$log" 2>&1 || status=1
  summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|skipped|error)' "$log" | tail -1)
  echo "megatron-core $v: ${summary:-no summary, see $log}"
  echo "$(date -u +%F) megatron-core $v (Python 3.12, torch 2.11.0): ${summary:-?}" >> "$ENV/results.txt"
done
exit $status
