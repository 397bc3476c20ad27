#!/usr/bin/env bash
# The Python wheels a GPU machine without network lacks, gathered here for `tests/gpu/run_all.sh --wheels DIR`
# (docs/gpu.md, "The one-command GPU check"):
#
#   scripts/gpu_wheels.sh [DIR]                 gather them into DIR (default .gpu-wheels, ignored; needs the registry)
#   scripts/gpu_wheels.sh install DIR TARGET    install them into TARGET without network or dependency resolution:
#                                               what run_all.sh --wheels runs there (then PYTHONPATH=TARGET)
#
# The machine they are for: Python 3.12 (cp312, manylinux x86_64), torch 2.11 with CUDA and Triton, transformers
# 5.17, numpy, pyyaml, safetensors, tokenizers, huggingface-hub, rich, matplotlib, tensorboard, pyarrow, psutil,
# sympy, pytest; at most 64 MiB of files carried to it, this checkout's included. Gathered, one version each:
#   megatron-core    constraints-mcore-latest.txt's (0.17 and later are the Python 3.12 releases; this code runs
#                    0.16 to 0.19), its cp312 manylinux wheel
#   megatron-pdm     this checkout as a wheel (run_all.sh runs the checkout itself, first on sys.path)
#   transformers     constraints.txt's pin, the version the tests run (pure Python)
#   math-verify      the math tasks' reward, with its pure-Python dependencies at versions that satisfy each other
# Not torch (the machine's CUDA build), not Transformer Engine (its checks are skipped, saying so), not wandb (a
# binary wheel, imported only for logging.wandb). Prints each wheel's size and the total with the checkout's files;
# exit status 1 when that total is over 64 MiB.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}

if [ "${1:-}" = install ]; then
    [ $# -eq 3 ] || { echo "usage: scripts/gpu_wheels.sh install DIR TARGET" >&2; exit 2; }
    exec "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$3" "$2"/*.whl
fi
OUT=${1:-.gpu-wheels}
LIMIT=$((64 * 1024 * 1024))
# the wheel tags the machine installs: pip matches each manylinux version exactly
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux1_x86_64)

rm -rf "$OUT" && mkdir -p "$OUT"
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$OUT" -c constraints-mcore-latest.txt megatron-core
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$OUT" -c constraints.txt transformers \
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
"$PY" -m pip wheel -q --no-deps -w "$OUT" .

wheels=$(du -cb "$OUT"/*.whl | tail -n 1 | cut -f 1)
checkout=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- | tail -n 1 | cut -f 1)
du -h "$OUT"/*.whl
echo "wheels $((wheels / 1024)) KiB + checkout $((checkout / 1024)) KiB = $(((wheels + checkout) / 1024)) KiB" \
     "of the $((LIMIT / 1024)) KiB a GPU machine takes"
[ $((wheels + checkout)) -le $LIMIT ] || { echo "gpu_wheels.sh: over the 64 MiB limit" >&2; exit 1; }
