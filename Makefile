# Two entry points (see README): `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv on first use: torch==2.13.0 first (a CPU build where one is offered), then
# the project, so pip never swaps torch for another release.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LLAMA_STAMP := $(VENV)/.llama-cpp

.PHONY: setup demo test test-fast test-slow test-gpu lint format clean browser

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# the tests also run GGUF exports in llama.cpp: its binding is built once per CPU (cached)
$(LLAMA_STAMP): $(STAMP)
	scripts/install_llama_cpp.sh $(BIN)/python
	touch $(LLAMA_STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/llm-foundry train

# the chat page's test drives a real Chromium (Debian's package; installed once if missing)
browser:
	scripts/install_chromium.sh

test: $(STAMP) $(LLAMA_STAMP) browser
	$(BIN)/python -m pytest -q

# the quick loop while developing (about 2.5 minutes on 2 cores): all but the `slow` and `heavy` tests
test-fast: $(STAMP) $(LLAMA_STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not heavy"

test-slow: $(STAMP) $(LLAMA_STAMP)
	$(BIN)/python -m pytest -q -m slow

# the `cuda` tests (tests/test_cuda.py, a few minutes on one GPU): skipped, with the reason, where
# torch sees no GPU. DEVICE=cpu runs the same tests on the CPU (their logic), DEVICE=cuda:1 on
# another GPU (a device named that is missing is an error). PY=python3 runs them with another
# interpreter that has the project's dependencies, without .venv: src/ goes on PYTHONPATH. ARGS go
# to pytest (ARGS="--durations=10", say).
PY ?= $(BIN)/python
test-gpu: $(if $(filter $(BIN)/python,$(PY)),$(STAMP))
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m pytest -q -rs -m cuda $(ARGS) \
		$(if $(DEVICE),--device $(DEVICE)) tests/test_cuda.py tests/test_decode_graph.py

lint: $(STAMP)
	$(BIN)/ruff check src tests tutorials benchmarks
	$(BIN)/ruff format --check src tests tutorials benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests tutorials benchmarks
	$(BIN)/ruff check --fix src tests tutorials benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
