#!/usr/bin/env bash
# Every GPU check in one command, from the repository root of an installed checkout (pip install -e ".[gpu]"):
#
#   tests/gpu/run_all.sh [--out DIR] [--budget SECONDS] [--no-gpu] [--wheels DIR [--site TARGET]]
#
# --wheels: a machine that has torch (CUDA, Triton) but not megatron-core, this package or its other dependencies,
# and no network (a lent GPU machine): first installs the wheels scripts/gpu_wheels.sh gathered into DIR (run there,
# carried along) into TARGET (default $TMPDIR/megatron-pdm-site) with `scripts/gpu_wheels.sh install`, then runs
# with PYTHONPATH=TARGET and python3 (or $PYTHON). Transformer Engine is not among them: its checks say so.
#
#   train_tp1    megatron-pdm train, examples/tiny_cpu.yaml on CUDA: 3 RL steps after a 30-step warm start (so
#                that rewards differ and gradients flow), bf16 training and rollout, the embedded engine, TP 1
#   train_tp2    the same at TP 2 (needs 2 GPUs)
#   policy_loss  policy_loss on CUDA against the float64 CPU references (tests/gpu/test_policy_loss_gpu.py)
#   kernels      the Triton kernels' checks and timing table (benchmarks/gpu_vocab_parallel.py)
#   te_spec      the Transformer Engine layer spec against transformers (tests/gpu/test_models_gpu.py)
#   moe          the trainer's MoE settings against the plain path on one GPU (tests/gpu/test_moe_gpu.py): routed-
#                expert replay under full recompute, the allgather dispatcher, and where installed DeepEP's flex
#                dispatcher (deep_ep) and Transformer Engine's grouped GEMM (each case skipped without its package)
#   train_offload  train_tp1 with the distributed optimizer's state in host memory (optim.cpu_offload=1: megatron's
#                hybrid-device optimizer, CPU Adam)
#   train_cp2    train_tp1 at context parallelism 2, through Transformer Engine's attention (needs 2 GPUs)
#   train_dsv3   examples/tiny_deepseek_v3.yaml on CUDA through the Transformer Engine spec (multi-latent attention,
#                sigmoid routing with the expert bias) from the block-FP8 checkpoint its script writes: bf16, 3 RL steps
#   sglang       real SGLang: top-K log-probs and weight updates of a bf16 engine, and its weight-update session
#                contract (status and body per case: session/*), with the engine interpreter's sglang, torch,
#                transformers and flashinfer versions (engine/*) (tests/gpu/test_sglang_engine.py; needs
#                `import sglang` in $MEGATRON_PDM_ENGINE_PYTHON, `make engine-env`'s, else in this python;
#                GPU_CHECK_SGLANG_ALL=1 runs every test of the file, about 5 minutes)
#
# Each check has its own time limit, cut to what is left of --budget (default 450 s, so that the whole stays under
# 8 minutes); a check that cannot run here is "skipped (why)", one that fails does not stop the others. Logs and
# results go under --out (default benchmarks/results/gpu): logs/<check>.log, runs/, the checks' JSON files, and
# summary.json (each check's status, seconds and key numbers), also printed as a table. Exit status 1 if a check
# that ran failed or timed out, 2 if the environment is not installed, else 0. --no-gpu skips every GPU check
# (what a machine without CUDA does anyway): the script and its summary, checked on a CPU.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2

OUT=benchmarks/results/gpu
BUDGET=450
NO_GPU=0
WHEELS=
SITE=${TMPDIR:-/tmp}/megatron-pdm-site
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=$2; shift 2 ;;
        --budget) BUDGET=$2; shift 2 ;;
        --no-gpu) NO_GPU=1; shift ;;
        --wheels) WHEELS=$2; shift 2 ;;
        --site) SITE=$2; shift 2 ;;
        -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        *) echo "run_all.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && [ -z "$WHEELS" ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export NO_VCS_VERSION=1  # megatron-core 0.17+ would run `git rev-parse` at import and report this checkout's hash
if [ -n "$WHEELS" ]; then
    if ! PYTHON=$PY scripts/gpu_wheels.sh install "$WHEELS" "$SITE"; then
        echo "run_all.sh: installing the wheels of $WHEELS into $SITE failed (gather them with scripts/gpu_wheels.sh)"
        exit 2
    fi
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
now() { date +%s.%N; }
START=$(now)

mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
CHECKS=(train_tp1 train_tp2 policy_loss kernels te_spec moe train_offload train_cp2 train_dsv3 sglang)
# the previous run's outputs only (--out may be a directory that holds other things)
for check in "${CHECKS[@]}"; do rm -rf "$OUT/runs/$check" "$OUT/logs/$check.log"; done
rm -f "$OUT"/{steps.jsonl,summary.json,policy_loss_gpu.json,gpu_vocab_parallel.json,sglang_gpu.json}
mkdir -p "$OUT/logs" "$OUT/runs"
export MEGATRON_PDM_GPU_OUT=$OUT  # where the pytest checks write their numbers

# the machine, as one JSON line, then the flags the checks need
if ! DETECT=$(NO_GPU=$NO_GPU "$PY" - <<'EOF' 2>"$OUT/logs/environment.log"
import json, os, platform
import torch
import megatron.core
import megatron_pdm
from megatron_pdm.models.gpt import te_available
from megatron_pdm.vocab_parallel import kernels

cuda = torch.cuda.is_available() and os.environ["NO_GPU"] != "1"
import subprocess, sys
engine_python = os.environ.get("MEGATRON_PDM_ENGINE_PYTHON") or sys.executable  # make engine-env's, or ours
sglang = cuda and subprocess.run([engine_python, "-c", "import sglang"], capture_output=True).returncode == 0
env = {"python": platform.python_version(), "torch": torch.__version__, "megatron_core": megatron.core.__version__,
       "cuda": cuda, "gpus": torch.cuda.device_count() if cuda else 0,
       "gpu": torch.cuda.get_device_name() if cuda else None, "triton": kernels.triton_available(),
       "transformer_engine": cuda and te_available(), "sglang": sglang}
print(json.dumps(env))
print(int(env["cuda"]), env["gpus"], int(env["triton"]), int(env["transformer_engine"]), int(sglang))
EOF
); then
    echo "run_all.sh: $PY cannot import torch, megatron-core and megatron_pdm (see $OUT/logs/environment.log);"
    echo "install the repository first: pip install -e \".[gpu]\" (or set PYTHON=/path/to/python)"
    exit 2
fi
ENV_JSON=$(head -n 1 <<<"$DETECT")
read -r CUDA GPUS TRITON TE SGLANG < <(tail -n 1 <<<"$DETECT")
echo "environment: $ENV_JSON"

why_not() {  # why a check that needs $1 cannot run here (nothing when it can)
    [ "$CUDA" = 1 ] || { echo "no CUDA"; return; }
    case $1 in
        2gpus) [ "$GPUS" -ge 2 ] || echo "needs 2 GPUs, found $GPUS" ;;
        triton) [ "$TRITON" = 1 ] || echo "no Triton" ;;
        te) [ "$TE" = 1 ] || echo "no Transformer Engine" ;;
        sglang) [ "$SGLANG" = 1 ] || echo "import sglang fails" ;;
    esac
}

record() {  # name kind status seconds rc
    printf '{"name": "%s", "kind": "%s", "status": "%s", "seconds": %s, "rc": %s, "log": "%s"}\n' \
        "$1" "$2" "$3" "$4" "$5" "$OUT/logs/$1.log" >>"$OUT/steps.jsonl"
}

run_check() {  # name kind needs limit_s command...
    local name=$1 kind=$2 needs=$3 limit=$4
    shift 4
    local why left t0 rc status secs
    why=$(why_not "$needs")
    left=$(awk -v s="$START" -v now="$(now)" -v b="$BUDGET" 'BEGIN { printf "%d", b - (now - s) }')
    [ "$left" -lt "$limit" ] && limit=$left
    if [ -z "$why" ] && [ "$limit" -lt 20 ]; then why="out of time: ${left} s of the ${BUDGET} s budget left"; fi
    if [ -n "$why" ]; then
        echo "-- $name: skipped ($why)"
        record "$name" "$kind" "skipped ($why)" 0 null
        return
    fi
    echo "-- $name (limit ${limit} s): $*"
    t0=$(now)
    timeout -k 10 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
    rc=$?
    secs=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
    case $rc in
        0) status=passed ;;
        124 | 137) status="timeout (${limit} s)" ;;
        *) status="failed (exit $rc)" ;;
    esac
    tail -n 3 "$OUT/logs/$name.log" | sed 's/^/   /'
    echo "   $status in $secs s"
    record "$name" "$kind" "$status" "$secs" "$rc"
}

TRAIN=(-m megatron_pdm.cli train --config examples/tiny_cpu.yaml train.steps=3 train.warm_start_steps=30
       train.prompts_per_step=16 train.eval_every=3 train.eval_prompts=16 train.checkpoint_every=3
       precision.train=bf16 precision.rollout=bf16)
SGLANG_K=(-k "topk_logprobs and bfloat16")
[ "${GPU_CHECK_SGLANG_ALL:-0}" = 1 ] && SGLANG_K=()

run_check train_tp1 train cuda 75 "$PY" "${TRAIN[@]}" --run-dir "$OUT/runs/train_tp1" parallel.tensor=1
run_check train_tp2 train 2gpus 75 "$PY" "${TRAIN[@]}" --run-dir "$OUT/runs/train_tp2" parallel.tensor=2
rm -rf "$OUT"/runs/train_*/checkpoints  # results keep the runs' metrics, config and plot
run_check policy_loss policy_loss cuda 50 "$PY" -m pytest -q -s -p no:cacheprovider tests/gpu/test_policy_loss_gpu.py
run_check kernels kernels triton 120 "$PY" benchmarks/gpu_vocab_parallel.py --out "$OUT/gpu_vocab_parallel.json" \
    --warmup 2 --reps 5
run_check te_spec pytest te 50 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_models_gpu.py
run_check moe pytest cuda 60 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_moe_gpu.py
run_check train_offload train cuda 75 "$PY" "${TRAIN[@]}" --run-dir "$OUT/runs/train_offload" parallel.tensor=1 \
    optim.distributed_optimizer=true optim.cpu_offload=1
run_check train_cp2 train 2gpus 75 "$PY" "${TRAIN[@]}" --run-dir "$OUT/runs/train_cp2" parallel.tensor=1 \
    parallel.context=2
run_check train_dsv3 train te 90 bash -c "'$PY' examples/tiny_deepseek_v3.py --out '$OUT/runs/dsv3_init' && '$PY' \
    -m megatron_pdm.cli train --config examples/tiny_deepseek_v3.yaml --run-dir '$OUT/runs/train_dsv3' \
    train.init_path='$OUT/runs/dsv3_init/checkpoint' parallel.tensor=1 parallel.expert=1 train.steps=3 \
    train.eval_every=3 train.checkpoint_every=3 precision.train=bf16 precision.rollout=bf16"
rm -rf "$OUT"/runs/train_*/checkpoints "$OUT/runs/dsv3_init"
run_check sglang sglang sglang 300 "$PY" -m pytest -q -s -p no:cacheprovider tests/gpu/test_sglang_engine.py \
    "${SGLANG_K[@]}"

echo
"$PY" tests/gpu/summarize.py --steps "$OUT/steps.jsonl" --out "$OUT/summary.json" --environment "$ENV_JSON"
