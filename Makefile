# Two entry points for a fresh machine (Python 3.11, the CPU torch wheel reachable by pip):
#   make run    installs the environment and runs the main job
#   make test   installs the environment and runs the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test lint bench install
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	touch $@

run: install
	$(BIN)/megatron-pdm train --config examples/tiny_cpu.yaml --run-dir runs/tiny_cpu-$$(date +%Y%m%d-%H%M%S)

bench: install
	$(BIN)/python benchmarks/vocab_parallel.py

test: install
	$(BIN)/python -m pytest -q tests
	$(BIN)/ruff check .
	$(BIN)/lint-imports  # the layering (pyproject.toml, [tool.importlinter])

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
