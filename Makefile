# Two entry points, each doing all set-up on a fresh machine (virtual environment + dependencies):
#   make bench   -- the main job: benchmarks on a GPU (writes benchmarks/results/), or the accuracy check without one
#   make test    -- the test suite; without a GPU the Triton kernels run on the CPU through Triton's interpreter
#   make lint    -- ruff: formatting and lint rules (pyproject.toml), as CI runs them
# Extra arguments go through ARGS, e.g. `make bench ARGS="snake --quick"`.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Without a GPU, pin the CPU build of torch (on this project's machines pip finds it locally; elsewhere point pip at
# PyTorch's CPU wheel index with PIP_EXTRA_INDEX_URL). With a GPU, any torch >= 2.5 with CUDA will do.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch>=2.5,torch==2.13.0)
PYTEST_WORKERS ?= 2

.PHONY: bench test check lint format clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[all]"
	touch $(STAMP)

bench: $(STAMP)
	$(PY) -m sparsefuse bench $(ARGS)

check: $(STAMP)
	$(PY) -m sparsefuse check $(ARGS)

test: $(STAMP)
	$(if $(HAS_GPU),SPARSEFUSE_TEST_DEVICE=cuda,TRITON_INTERPRET=1) $(PY) -m pytest -n $(PYTEST_WORKERS) -q --durations=15 $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff format --check sparsefuse benchmarks tests examples
	$(VENV)/bin/ruff check sparsefuse benchmarks tests examples

format: $(STAMP)
	$(VENV)/bin/ruff format sparsefuse benchmarks tests examples
	$(VENV)/bin/ruff check --fix sparsefuse benchmarks tests examples

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
