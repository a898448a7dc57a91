#!/usr/bin/env bash
# make test-verl: fusedce.integrations.verl tested with verl itself, in its own venv under .cache/verl/
# (never committed; built once, reused): verl 0.9.1 needs transformers < 5.11 and ray, which the main .venv
# (transformers 5.25) cannot hold. torch==2.13.0 is installed first, from the same place `make install` takes
# it (the CPU wheel on this disk), so that nothing pulls a CUDA build; then verl 0.9.1 with transformers 5.9.0
# (the version verl's own cpu extra pins), and megatron-core 0.16.1 without its deps (as `make install` does:
# verl's Megatron modules then import, so their fused functions are patched and tested; 0.16 has no
# output_processor hook, so verl takes its legacy forward route). fusedce comes from this checkout (PYTHONPATH=src).
#   scripts/test_verl.sh [PYTEST ARGS ...]     (tests/verl/ and the extra pytest arguments; ~2 GB of downloads
#                                              and ~10 min the first time)
# $PYTHON311: the interpreter to build from (default: python3.11 on PATH, then pyenv's).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=.cache/verl/venv
PINS=(torch==2.13.0 verl==0.9.1 transformers==5.9.0 triton==3.9.0 pytest pytest-timeout hypothesis psutil)

find_python() {
  if [[ -n "${PYTHON311:-}" ]]; then echo "$PYTHON311"; return; fi
  command -v python3.11 2>/dev/null && return
  ls -d /root/.pyenv/versions/3.11.*/bin/python3.11 2>/dev/null | tail -1
}

build() {   # the venv, once (a stamp file marks a finished build)
  [[ -f $VENV/.built ]] && return 0
  local py
  py=$(find_python)
  if [[ -z "$py" ]]; then echo "test-verl: no python3.11 found (set \$PYTHON311)"; return 1; fi
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$py" -m venv "$VENV" && "$VENV/bin/python" -m pip install -q --upgrade pip \
    && "$VENV/bin/python" -m pip install -q "${PINS[0]}" \
    && "$VENV/bin/python" -m pip install -q "${PINS[@]}" \
    && "$VENV/bin/python" -m pip install -q --no-deps megatron-core==0.16.1 \
    && touch "$VENV/.built"
}

if ! build; then echo "test-verl: building $VENV FAILED"; exit 1; fi
"$VENV/bin/python" -c 'import sys, torch, transformers, verl
print(f"test-verl: Python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, verl {verl.__version__}")' || exit 1
TRITON_INTERPRET=1 PYTHONPATH=$ROOT/src:$ROOT/tests:$ROOT/tests/references \
  exec "$VENV/bin/python" -m pytest -p no:cacheprovider -rfEs tests/verl "$@"
