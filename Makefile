# Quick start:  make train   (tiny MSAR MoE on Shakespeare, a few minutes on CPU)
#               make test    (the CPU test suite; `make test-all` adds the slow tests)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=
PYTEST_ARGS ?= --durations=20

.PHONY: venv train test test-all lint format params clean

# CPU torch first when no CUDA GPU is visible: a bare `torch` requirement would pull a multi-GB
# CUDA build. On GPU machines pip resolves torch from pyproject as usual.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if nvidia-smi -L >/dev/null 2>&1; then echo "CUDA GPU found: torch from PyPI"; \
	 else $(BIN)/pip install --quiet torch==2.13.0; fi
	$(BIN)/pip install --quiet -e '.[dev,kernels,slurm,eval]'
	@touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(BIN)/msar-train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu" $(PYTEST_ARGS)

params: $(STAMP)
	$(BIN)/msar-params $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check msar_train tests scripts
	$(BIN)/ruff format --check msar_train tests scripts

format: $(STAMP)
	$(BIN)/ruff format msar_train tests scripts

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
