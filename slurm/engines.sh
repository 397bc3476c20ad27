#!/bin/bash
# Started by the batch script once per rollout node (srun, one task per node): the SGLang engines of this node.
# An engine of ROLLOUT_TP <= GPUS_PER_NODE GPUs: GPUS_PER_NODE / ROLLOUT_TP engines here, on ports ENGINE_PORT + i.
# An engine spanning nodes: ROLLOUT_TP / GPUS_PER_NODE nodes each, the first serving HTTP on ENGINE_PORT.
# Environment: ROLLOUT_NODE_LIST (the rollout nodes, in order), ROLLOUT_TP, GPUS_PER_NODE, ENGINE_PORT, RUN_DIR,
# ENGINE_GPU_ARGS (1 for SGLang), ENGINE_OWN_ENV (1: the engines run a Python of their own, rollout.sglang.engine_python
# or cluster.engine_image, and start without the trainer's PYTHONPATH and VIRTUAL_ENV), LOG_SUFFIX (-restart<N> on a
# requeued start: its own logs), and the engine command line as arguments.
set -euo pipefail
read -r -a ROLLOUT_NODES <<< "$ROLLOUT_NODE_LIST"
own=()
[ "${ENGINE_OWN_ENV:-0}" = 1 ] && own=(env -u PYTHONPATH -u VIRTUAL_ENV)
me=$SLURM_NODEID
mkdir -p "$RUN_DIR/logs"
if [ "$ROLLOUT_TP" -le "$GPUS_PER_NODE" ]; then
  for ((i = 0; i < GPUS_PER_NODE / ROLLOUT_TP; i++)); do
    gpu_args=()
    [ "$ENGINE_GPU_ARGS" = 1 ] && gpu_args=(--tp-size "$ROLLOUT_TP" --base-gpu-id $((i * ROLLOUT_TP)))
    "${own[@]}" "$@" "${gpu_args[@]}" --host 0.0.0.0 --port $((ENGINE_PORT + i)) > "$RUN_DIR/logs/engine-node$me-$i${LOG_SUFFIX:-}.log" 2>&1 &
  done
else
  per=$((ROLLOUT_TP / GPUS_PER_NODE))
  rank=$((me % per))
  head=${ROLLOUT_NODES[$((me - rank))]}
  "${own[@]}" "$@" --tp-size "$ROLLOUT_TP" --nnodes "$per" --node-rank "$rank" --dist-init-addr "$head:$((ENGINE_PORT + 100))" \
    --host 0.0.0.0 --port "$ENGINE_PORT" > "$RUN_DIR/logs/engine-node$me${LOG_SUFFIX:-}.log" 2>&1 &
fi
wait
