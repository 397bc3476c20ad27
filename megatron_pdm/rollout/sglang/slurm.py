"""The SGLang engines' block of `megatron-pdm submit`'s batch script (`slurm_block`, the engine spec's launch
block): the engine command line (SGLang's, or `megatron-pdm serve` on a CPU cluster), the block-FP8 copy FP8 engines
start from, the engines' interpreter, their health check and sglang-router."""

from __future__ import annotations

import shlex

from megatron_pdm._validate import check_one_line
from megatron_pdm.models.tokenizer import has_tokenizer
from megatron_pdm.precision import check_fp8_block_shapes, rollout_engine_dtype

from ..spec import SlurmJob
from .launcher import check_engine_heads, serve_args, sglang_args


def _engine_python(cfg, job: SlurmJob) -> str:
    """The SGLang engines' (and sglang-router's) interpreter: rollout.sglang.engine_python (an environment of their
    own, `make engine-env`), else the job's (`python` inside a container)."""
    c = cfg.cluster
    return cfg.rollout.sglang.engine_python or ("python" if c.engine_image or c.container_image else job.python)


def _engine_env_own(cfg, job: SlurmJob) -> bool:
    """Whether the SGLang engines (and sglang-router) run another Python than the trainer's
    (rollout.sglang.engine_python, or cluster.engine_image): then they start without the trainer's PYTHONPATH and
    VIRTUAL_ENV, which would import the trainer's packages into sglang's environment (`engines.sh`,
    ENGINE_OWN_ENV)."""
    c = cfg.cluster
    return c.gpu != "cpu" and (_engine_python(cfg, job) != job.job_python
                               or bool(c.engine_image and c.engine_image != c.container_image))


FP8_MODEL = '"$RUN_DIR/weights/fp8-init"'  # FP8 rollout: the block-FP8 copy of train.init_path the job makes


def _engine_command(cfg, job: SlurmJob) -> tuple[str, bool]:
    """The engine command line, and whether it takes SGLang's GPU arguments (--tp-size, --base-gpu-id, multi-node).
    FP8 engines start from a block-FP8 copy of the checkpoint (FP8_MODEL, no --quantization): SGLang takes the
    trainer's block-FP8 weight updates only into an engine started so."""
    c, p = cfg.cluster, cfg.precision
    if cfg.train.init != "hf":
        raise ValueError("train.init: the rollout engines start from an HF checkpoint (train.init hf, "
                         f"train.init_path), got {cfg.train.init!r}")
    dtype, quantization = rollout_engine_dtype(p.rollout)
    check_one_line("train.init_path", str(cfg.train.init_path))
    for arg in cfg.rollout.sglang.server_args:
        check_one_line("rollout.sglang.server_args", arg)
    py = job.job_python

    def command(args: list[str]) -> str:  # each word quoted; the model path the FP8 copy's, a shell expansion
        words = [shlex.quote(a) for a in args]
        if quantization == "fp8":
            words[args.index("--model-path", 1) + 1] = FP8_MODEL
        return " ".join(words)

    model = str(cfg.train.init_path)
    if c.gpu == "cpu":  # the embedded engine behind SGLang's HTTP API (SGLang itself needs a GPU here)
        return command(serve_args(model, dtype=dtype, python=py)), False
    check_engine_heads(cfg.model, c.rollout_tp, field="cluster.rollout_tp", server_args=cfg.rollout.sglang.server_args)
    if quantization == "fp8":
        check_fp8_block_shapes(cfg.model, c.rollout_tp, field="cluster.rollout_tp")
    colocated = not c.rollout_nodes  # the share `plan` leaves beside the trainer; released while it trains
    fraction = job.colocated_fraction() if colocated else None
    # --skip-tokenizer-init unless the checkpoint has tokenizer files (the FP8 copy takes them along)
    args = sglang_args(model, dtype=dtype, kv_cache_dtype=p.kv_cache, mem_fraction_static=fraction,
                       memory_saver=colocated, skip_tokenizer_init=not has_tokenizer(cfg.train.init_path),
                       routed_experts=cfg.rollout.routed_experts, server_args=cfg.rollout.sglang.server_args,
                       python=_engine_python(cfg, job))
    return command(args), True


def _fp8_export_block(cfg, job: SlurmJob) -> str:
    py = shlex.quote(job.job_python)
    return f'''# FP8 rollout: the engines start from a block-FP8 copy of the checkpoint (made once per run directory)
srun --overlap --nodes=1 --ntasks=1 --relative=0 "${{CONTAINER[@]}}" \\
  {py} -m megatron_pdm.rollout.sglang.fp8_export {shlex.quote(str(cfg.train.init_path))} {FP8_MODEL}
'''


def slurm_block(cfg, job: SlurmJob) -> str:
    """The batch script's engine block: the FP8 export, the engines (slurm/engines.sh on the rollout nodes, or the
    training nodes when colocated), their health check, the router, and the overrides that point the trainer at
    them."""
    c = cfg.cluster
    first, count = (c.nodes - c.rollout_nodes, c.rollout_nodes) if c.rollout_nodes else (0, c.nodes)
    if c.rollout_tp > c.gpus_per_node and c.rollout_tp % c.gpus_per_node:
        raise ValueError(f"cluster.rollout_tp: {c.rollout_tp} must be a multiple of gpus_per_node "
                         f"{c.gpus_per_node} for an engine spanning nodes")
    if c.rollout_tp <= c.gpus_per_node and c.gpus_per_node % c.rollout_tp:
        raise ValueError(f"cluster.rollout_tp: {c.rollout_tp} must divide gpus_per_node {c.gpus_per_node}")
    if c.rollout_tp > c.gpus_per_node and count % (c.rollout_tp // c.gpus_per_node):
        raise ValueError(f"cluster.rollout_tp: {c.rollout_tp} GPUs per engine do not tile {count} rollout nodes of "
                         f"{c.gpus_per_node} GPUs")
    command, gpu_args = _engine_command(cfg, job)
    export = _fp8_export_block(cfg, job) if cfg.precision.rollout == "fp8" else ""
    engine_tp = c.rollout_tp if gpu_args else 1  # the trainer sizes its weights group with it; serve is 1 process
    where = f"on nodes {first}..{first + count - 1}" if c.rollout_nodes else "colocated on the training nodes"
    overrides = (f'"rollout.sglang.urls=[$(IFS=,; echo "${{URLS[*]}}")]" "rollout.sglang.engine_tp={engine_tp}"'
                 + ("" if c.rollout_nodes else ' "rollout.sglang.release_memory=true"'))
    own = gpu_args and _engine_env_own(cfg, job)
    unset = "env -u PYTHONPATH -u VIRTUAL_ENV " if own else ""  # engines.sh does the same for the engines
    router, engine_py = "", shlex.quote(_engine_python(cfg, job))
    if job.router:
        router = f'''
# sglang-router in front of the engines: one endpoint for evaluation and other clients (the trainer sends rollouts
# round-robin to every engine itself and pushes weights to each)
srun --overlap --nodes=1 --ntasks=1 --relative=0 "${{ENGINE_CONTAINER[@]}}" \\
  {unset}{engine_py} -m sglang_router.launch_router --host 0.0.0.0 --port {job.router_port} \\
  --prometheus-port {job.router_port + 1} \\
  --worker-urls "${{URLS[@]}}" > "$RUN_DIR/logs/router$LOG_SUFFIX.log" 2>&1 &
echo "router: http://$HEAD:{job.router_port}"'''
    env = (f"interpreter {_engine_python(cfg, job)}" + (f", image {c.engine_image or c.container_image}"
                                                         if c.engine_image or c.container_image else "")
           if gpu_args else "megatron-pdm serve")
    return f'''{export}# rollout: SGLang engines of {c.rollout_tp} GPU(s) {where} ({env})
ROLLOUT_FIRST={first}
ROLLOUT_COUNT={count}
export ROLLOUT_NODE_LIST="${{NODES[*]:ROLLOUT_FIRST:ROLLOUT_COUNT}}" ROLLOUT_TP={c.rollout_tp} \\
  GPUS_PER_NODE ENGINE_PORT={job.engine_port} RUN_DIR ENGINE_GPU_ARGS={int(gpu_args)} ENGINE_OWN_ENV={int(own)}
srun --overlap --nodes="$ROLLOUT_COUNT" --ntasks-per-node=1 --relative="$ROLLOUT_FIRST" "${{ENGINE_CONTAINER[@]}}" \\
  bash "$(dirname "$CONFIG")/engines.sh" {command} &
ENGINES_PID=$!
URLS=()
for ((n = ROLLOUT_FIRST; n < ROLLOUT_FIRST + ROLLOUT_COUNT; n++)); do
  if [ "$ROLLOUT_TP" -le "$GPUS_PER_NODE" ]; then
    for ((i = 0; i < GPUS_PER_NODE / ROLLOUT_TP; i++)); do URLS+=("http://${{NODES[$n]}}:$((ENGINE_PORT + i))"); done
  elif [ $(((n - ROLLOUT_FIRST) % (ROLLOUT_TP / GPUS_PER_NODE))) -eq 0 ]; then
    URLS+=("http://${{NODES[$n]}}:$ENGINE_PORT")
  fi
done
{_health_check(cfg, job)}
OVERRIDES+=({overrides}){router}'''


def _health_check(cfg, job: SlurmJob) -> str:
    """Wait for every engine's /health, failing as soon as the engines' srun exits. In a container the check runs
    inside it (the host may lack the package), and the batch shell watches the engines' process itself."""
    if not cfg.cluster.container_image:
        return (f'{shlex.quote(job.python)} -m megatron_pdm.rollout.sglang.health --timeout 1800 --pid "$ENGINES_PID" '
                '"${URLS[@]}"')
    return '''srun --overlap --nodes=1 --ntasks=1 --relative=0 "${CONTAINER[@]}" \\
  python -m megatron_pdm.rollout.sglang.health --timeout 1800 "${URLS[@]}" &
HEALTH_PID=$!
while kill -0 "$HEALTH_PID" 2>/dev/null; do
  if ! kill -0 "$ENGINES_PID" 2>/dev/null; then
    echo "$(date -Is) the engines exited before they were healthy (see $RUN_DIR/logs/engine-*)"; kill "$HEALTH_PID"
    exit 1
  fi
  sleep 2
done
wait "$HEALTH_PID"'''


