# eagle3 developer entry points. `make demo` and `make test` are the two set-up commands.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.eagle3-installed
# 2 workers: the CI machine has 2 cores. worksteal: an idle worker takes queued tests from the other,
# so a few long serve / multi-node tests near the end no longer leave one core idle (10:56 -> 9:56).
PYTEST_ARGS ?= -n 2 --dist worksteal

.PHONY: venv test demo lint clean

venv: $(STAMP)

# CPU torch 2.13.0 is installed only when the venv has no torch at all: an unpinned torch requirement
# would otherwise pull several GB of CUDA wheels. A venv with a ROCm/CUDA torch already in it is kept.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[all]"
	@# AMD Quark compiles its C++ extension on its first import (about 30 CPU-s, cached under
	@# ~/.cache/torch_extensions): built here, with the rest of the install, not in the first test
	@# (or `quantize --engine quark`) that imports Quark.
	$(PY) -c "import quark.torch.kernel" > /dev/null
	touch $(STAMP)

# The suite starts a few hundred Python processes (CLI runs, servers, tensor-parallel ranks), each
# importing eagle3. Where PYTHONDONTWRITEBYTECODE is set (as on the CI machines) none of them caches
# its bytecode, so each compiled eagle3's modules again: compiled once here (under 1 s), the suite took
# 11 % less CPU (1111 -> 983 s, `-p tests.cpu_report`). Python still reads bytecode with that variable set.
test: venv
	$(PY) -m compileall -q eagle3 tests > /dev/null
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check eagle3 tests benchmarks

demo: venv
	PATH="$(abspath $(VENV))/bin:$$PATH" bash scripts/demo.sh

clean:
	rm -rf demo-out .pytest_cache
