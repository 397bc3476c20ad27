"""`megatron-pdm submit`: a config -> a Slurm batch script (from the templates in `slurm/`) -> sbatch.

The script trains on the first nodes of the allocation (`srun` + one `torchrun` per node with a c10d rendezvous
on the first node, or `srun` with one task per rank), starts the SGLang engines (colocated on the training nodes
or on nodes of their own) and fills `rollout.sglang.urls` with them, exports the NCCL / Transformer Engine environment,
and handles the time limit: a watcher in the job asks the trainer to stop once the time left is within the stop
warning lead, which it derives from the run's measured step and checkpoint times (`stop_warning_s`), and Slurm
sends USR1 `signal_s` seconds before it as well; the trainer checkpoints and the job requeues itself
(`--requeue`), resuming from the checkpoint (`train --auto-resume`). Every requeued start writes its own log files
(`-restart<N>`). A sweep (`grid`) is a job array, one run directory per point; `chain` submits jobs that each
start when the previous one ended.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_pdm._rundir import REQUEUE_FILE, STOP_FILE, RunDir
from megatron_pdm._validate import check_choice, check_int, check_one_line, is_number
from megatron_pdm.rollout.engines import engine_spec
from megatron_pdm.rollout.spec import SlurmJob
from megatron_pdm.train.config import apply_overrides, config_from_dict, slurm_time_s

TEMPLATES = Path(__file__).resolve().parents[2] / "slurm"
LAUNCHERS = ("torchrun", "srun")
ENGINE_PORT = 30000
ROUTER_PORT = 29000
# what every GPU job exports (cluster.env adds to and overrides these)
GPU_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # megatron's TP / SP communication overlap relies on in-order kernels
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed collective kills the job instead of hanging it
    "NCCL_DEBUG": "WARN",
    "NVTE_FUSED_ATTN": "1",
    "PYTHONUNBUFFERED": "1",
}
CPU_ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
# the stop warning (cluster.stop_warning_s 0): 2 x the mean measured step plus the checkpoint time, at least
# MIN_STOP_WARNING_S, at most half the time limit. Before any step is measured a step counts UNMEASURED_STEP_S
# (NeMo-RL measures 134-395 s per step from 30B-A3B to 235B); Slurm's USR1 comes at that lead, and the job's
# watcher stops earlier once its measured steps are longer (verl: 1,700 s per step for DeepSeek-V3 on 96 H20).
MIN_STOP_WARNING_S = 300
UNMEASURED_STEP_S = 300
MEASURED_STEPS = 20  # the mean is over the last this many logged steps
# the checkpoint time: the longest of the last this many saves the trainer measured (perf/checkpoint_s), else an
# estimate of what one node writes (torch.save of every rank's shard to a shared file system) at this many bytes / s
MEASURED_CHECKPOINTS = 5
CHECKPOINT_WRITE_BYTES_PER_S = 2**30


@dataclass(frozen=True)
class Submission:
    """Everything `render` needs beside the config."""

    run_dir: Path
    launcher: str = "torchrun"
    grid: tuple[tuple[str, ...], ...] = ()  # the overrides of each array task
    signal_s: int = MIN_STOP_WARNING_S  # Slurm's USR1 lead at submission (`stop_warning_s`); the job re-derives it
    router: bool = False
    python: str = field(default_factory=lambda: sys.executable)
    sbatch_args: tuple[str, ...] = ()  # extra sbatch options, one word each (`--qos=high`, `--comment=a b`)

    def __post_init__(self):
        check_choice("launcher", self.launcher, LAUNCHERS)
        check_int("signal", self.signal_s)  # seconds
        # all three go into the batch script, the run directory into #SBATCH --output as well (see _sbatch_word)
        check_one_line("run_dir", str(self.run_dir))
        if "\\" in str(self.run_dir):  # --output: it turns off the %j patterns (a job so named failed on 22.05)
            raise ValueError(f"run_dir: {str(self.run_dir)!r} holds a backslash, which Slurm's --output cannot carry")
        check_one_line("python", self.python)
        for arg in self.sbatch_args:
            if not check_one_line("sbatch_arg", arg).startswith("-"):
                raise ValueError(f"sbatch_arg: {arg!r} is not an sbatch option (--name=value)")


def time_limit_s(text: str) -> int:
    """A Slurm time (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in seconds."""
    return slurm_time_s(text)


def _logged(run_dir, key: str) -> list[list[float]]:
    """The values of `key` the trainer logged, in order, in <run_dir>/metrics.jsonl and (a grid) in each point's
    <run_dir>/*/metrics.jsonl: one list per file that has any. Lines being written and non-numbers are skipped."""
    run_dir = Path(run_dir)
    series = []
    metrics = RunDir(run_dir).metrics
    for path in [metrics, *sorted(run_dir.glob(f"*/{metrics.name}"))]:
        if not path.is_file():
            continue
        values = []
        for line in path.read_text().splitlines():
            try:
                v = json.loads(line).get(key)
            except (ValueError, AttributeError):
                continue  # a line being written
            if is_number(v) and math.isfinite(v) and v >= 0:
                values.append(float(v))
        if values:
            series.append(values)
    return series


def measured_step_s(run_dir) -> float | None:
    """The mean `perf/step_s` of the last MEASURED_STEPS steps the trainer logged in <run_dir>/metrics.jsonl (for a
    grid, the slowest point's), or None before any step was measured."""
    means = []
    for values in _logged(run_dir, "perf/step_s"):
        last = [v for v in values if v > 0][-MEASURED_STEPS:]
        if last:
            means.append(sum(last) / len(last))
    return max(means) if means else None


def measured_checkpoint_s(run_dir) -> float | None:
    """The longest of the last MEASURED_CHECKPOINTS checkpoint saves the trainer measured (`perf/checkpoint_s`,
    logged on the row after each save) in <run_dir>/metrics.jsonl (for a grid, over every point), or None before
    any save was measured."""
    longest = [max(v[-MEASURED_CHECKPOINTS:]) for v in _logged(run_dir, "perf/checkpoint_s")]
    return max(longest) if longest else None


def checkpoint_s(cfg) -> float:
    """Estimated seconds to write a checkpoint (before the trainer has measured one, `measured_checkpoint_s`): each
    training node writes its ranks' weights and optimizer states (GPU and CPU-offloaded shares, `plan.host_memory`)
    at CHECKPOINT_WRITE_BYTES_PER_S. 0 on a CPU cluster, which `plan` does not model."""
    if cfg.cluster.gpu == "cpu":
        return 0.0
    from megatron_pdm.cluster.plan import ADAM_BYTES, OFFLOADED_GRAD_BYTES, plan

    p = plan(cfg, top=0)
    offloaded = p.host.optimizer * ADAM_BYTES[cfg.precision.train] / (ADAM_BYTES[cfg.precision.train]
                                                                       + OFFLOADED_GRAD_BYTES)
    return (p.host.checkpoint + offloaded) / CHECKPOINT_WRITE_BYTES_PER_S


def stop_warning_s(cfg, run_dir) -> int:
    """Seconds before the time limit to stop and checkpoint: cluster.stop_warning_s when set; else
    max(MIN_STOP_WARNING_S, 2 x step + checkpoint) with step the run's measured mean (`measured_step_s`, e.g. of a
    run resubmitted into its run directory) or UNMEASURED_STEP_S and checkpoint its measured saves
    (`measured_checkpoint_s`) or the estimate (`checkpoint_s`), at most half the time limit (a lead as long as the
    job would stop it at once). The job script re-derives the same bound from every step and save it measures."""
    if cfg.cluster.stop_warning_s:
        return cfg.cluster.stop_warning_s
    step = measured_step_s(run_dir) or UNMEASURED_STEP_S
    save = measured_checkpoint_s(run_dir)
    lead = max(MIN_STOP_WARNING_S, math.ceil(2 * step + (checkpoint_s(cfg) if save is None else save)))
    return max(1, min(lead, time_limit_s(cfg.cluster.time) // 2))


def expand_grid(specs: list[str]) -> tuple[tuple[str, ...], ...]:
    """['objective.mask=ppo,pdm', 'precision.rollout=bf16,fp8'] -> every combination as override tuples."""
    axes = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or "." not in key or not values:
            raise ValueError(f"grid {spec!r}: expected section.key=v1,v2,...")
        vals = values.split(",")
        if any(not v or any(c.isspace() for c in v) for v in vals):
            raise ValueError(f"grid {spec!r}: values must be non-empty and contain no whitespace")
        axes.append([f"{key}={v}" for v in vals])
    return tuple(itertools.product(*axes)) if axes else ()


def _sbatch_word(text: str) -> str:
    """One word of an #SBATCH line as sbatch's directive parser reads it (bash reads the line as a comment): the
    text as is when it holds nothing but safe characters, else in double quotes with `\\` and `"` escaped by a
    backslash. Spaces and `#` are then part of the word; a newline cannot be (refused at load)."""
    if re.fullmatch(r"[\w@%+=:,./-]+", text, flags=re.ASCII):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _sbatch_header(cfg, sub: Submission) -> list[str]:
    c = cfg.cluster
    gpu = c.gpu != "cpu"
    per_node = 1 if sub.launcher == "torchrun" else c.gpus_per_node
    log = "slurm-%A_%a.out" if sub.grid else "slurm-%j.out"
    logs = str(RunDir(sub.run_dir).logs).replace("%", "%%")  # --output expands %j and the like; %% is a literal %
    lines = [
        f"--job-name=mpdm-{sub.run_dir.name}"[:64],
        f"--nodes={c.nodes}",
        f"--ntasks-per-node={per_node}",
        f"--time={c.time}",
        f"--output={logs}/{log}",
        "--open-mode=append",  # a requeued job appends to its log
        "--requeue",
        f"--signal=B:USR1@{sub.signal_s}",  # to the batch shell only: torchrun would die of a USR1
    ]
    if gpu:
        lines += [f"--gpus-per-node={c.gpus_per_node}", "--exclusive"]
    elif sub.launcher == "torchrun":
        lines.append(f"--cpus-per-task={c.gpus_per_node}")
    if c.partition:
        lines.append(f"--partition={c.partition}")
    if c.account:
        lines.append(f"--account={c.account}")
    if sub.grid:
        lines.append(f"--array=0-{len(sub.grid) - 1}")
    lines += list(sub.sbatch_args)
    return [f"#SBATCH {_sbatch_word(x)}" for x in lines]


def _python(cfg, sub: Submission) -> str:
    """The interpreter the job runs: the container's `python`, else this one (a path that may hold spaces: quote
    it where it goes into the script)."""
    return "python" if cfg.cluster.container_image else sub.python


def _train_command(cfg, sub: Submission) -> str:
    py = shlex.quote(_python(cfg, sub))
    train = '-m megatron_pdm.cli train --config "$CONFIG" --run-dir "$RUN_DIR" --auto-resume "${OVERRIDES[@]}"'
    if sub.launcher == "torchrun":
        return ('srun --nodes="$TRAIN_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 "${CONTAINER[@]}" \\\n'
                f'  {py} -m torch.distributed.run --nnodes="$TRAIN_NODES" --nproc-per-node="$GPUS_PER_NODE" \\\n'
                '  --rdzv-backend=c10d --rdzv-endpoint="$HEAD:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \\\n'
                f'  {train.replace("-m megatron_pdm.cli", "--module megatron_pdm.cli")}')
    # one task per rank: launch.py maps SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID to RANK / WORLD_SIZE / LOCAL_RANK
    return ('MEGATRON_PDM_SLURM_RANKS=1 srun --nodes="$TRAIN_NODES" --ntasks-per-node="$GPUS_PER_NODE" '
            '--kill-on-bad-exit=1 "${CONTAINER[@]}" \\\n'
            f'  {py} {train}')


def _rollout_block(cfg, sub: Submission) -> str:
    """The engine spec's launch block: the lines that start the engines' servers (none for an engine in the
    trainer)."""
    spec = engine_spec(cfg.rollout.engine)
    if spec.slurm_block is None:
        return (f"# rollout: the {spec.name} engine inside the trainer (rollout.engine {spec.name}); no servers to "
                "start")

    def colocated_fraction() -> float:  # the share `plan` leaves engines beside the trainer
        from megatron_pdm.cluster.plan import plan

        return plan(cfg, top=0).rollout.mem_fraction_static

    return spec.slurm_block(cfg, SlurmJob(python=sub.python, job_python=_python(cfg, sub), router=sub.router,
                                          engine_port=ENGINE_PORT, router_port=ROUTER_PORT,
                                          colocated_fraction=colocated_fraction))


def _check_engine_room(cfg) -> None:
    """Colocated engine servers on GPUs: `plan` must leave them a positive mem_fraction_static, whatever --force
    says (SGLang cannot start with none)."""
    c = cfg.cluster
    if not engine_spec(cfg.rollout.engine).servers or c.gpu == "cpu" or c.rollout_nodes:
        return
    from megatron_pdm.cluster.plan import plan

    r = plan(cfg, top=0).rollout
    if r.mem_fraction_static <= 0:
        raise ValueError(f"rollout: does not fit: {r.problem}; use more nodes, optim.cpu_offload, or cluster."
                         "rollout_nodes for engines of their own")


def _env_block(cfg) -> str:
    env = {**(CPU_ENV if cfg.cluster.gpu == "cpu" else GPU_ENV), **{k: str(v) for k, v in cfg.cluster.env.items()}}
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())


# what a grid point's config may change in the one script a job array runs: only what the trainer reads (each task
# passes its point's overrides to `train`). These placeholders are rendered once, from the config, for every task;
# a grid axis whose points render one of them differently is refused (`_check_grid_shares`).
SHARED_PARTS = {"SBATCH": "the #SBATCH header", "ROLLOUT": "the engine block (engine flags, FP8 export)",
                "TRAIN": "the training command", "ENV": "the environment", "CONTAINER": "the container flags",
                "ENGINE_CONTAINER": "the engines' container flags", "TRAIN_NODES": "the training nodes",
                "GPUS_PER_NODE": "the GPUs per node", "STOP_WARNING_FIXED": "the stop warning",
                "TIME_LIMIT_S": "the time limit"}


def _values(cfg, sub: Submission) -> dict[str, str]:
    """The template's placeholders for `cfg` (one grid point's config, or the config without a grid)."""
    c = cfg.cluster

    def container(image):  # pyxis flags for one image, every srun of its processes
        if not image:
            return ""
        return shlex.join([f"--container-image={image}", "--container-workdir=" + str(Path.cwd())]
                          + ([f"--container-mounts={c.container_mounts}"] if c.container_mounts else []))

    return {
        "SBATCH": "\n".join(_sbatch_header(cfg, sub)),
        "SCRIPT": shlex.quote(str(RunDir(sub.run_dir).submit / "train.sbatch")),
        "SIGNAL_S": str(sub.signal_s),
        "STOP_WARNING_FIXED": str(int(bool(c.stop_warning_s))),
        "CHECKPOINT_S": str(math.ceil(checkpoint_s(cfg))),
        "MIN_STOP_WARNING_S": str(MIN_STOP_WARNING_S),
        "MEASURED_STEPS": str(MEASURED_STEPS),
        "MEASURED_CHECKPOINTS": str(MEASURED_CHECKPOINTS),
        "TIME_LIMIT_S": str(time_limit_s(c.time)),
        "LOG_DIR": shlex.quote(str(RunDir(sub.run_dir).logs)),
        "RUN_DIR": shlex.quote(str(sub.run_dir)),
        "GRID": " ".join(shlex.quote(" ".join(point)) for point in sub.grid),
        "STOP_FILE": STOP_FILE,
        "REQUEUE_FILE": REQUEUE_FILE,
        "ENV": _env_block(cfg),
        "TRAIN_NODES": str(c.nodes - c.rollout_nodes),
        "GPUS_PER_NODE": str(c.gpus_per_node),
        "CONTAINER": container(c.container_image),
        # megatron-pdm serve (a CPU cluster's engines) is the trainer's package: the job's image
        "ENGINE_CONTAINER": container(c.container_image if c.gpu == "cpu" else c.engine_image or c.container_image),
        "ROLLOUT": _rollout_block(cfg, sub),
        "TRAIN": _train_command(cfg, sub),
    }


def _check_grid_shares(grid: tuple[tuple[str, ...], ...], rendered: list[dict[str, str]]) -> None:
    """Every array task runs the one script: refuse, naming the axis and its values, a grid whose points render a
    SHARED_PARTS placeholder differently (a grid over precision.rollout would start every point's engines in the
    first point's dtype)."""
    shared = [tuple(r[k] for k in SHARED_PARTS) for r in rendered]
    if len(set(shared)) == 1:
        return
    axes = len(grid[0])
    for j in range(axes):  # the axis along which points that agree on every other axis render differently
        rows: dict[tuple, dict[str, tuple]] = {}
        for point, parts in zip(grid, shared, strict=True):
            rows.setdefault(point[:j] + point[j + 1:], {})[point[j]] = parts
        for row in rows.values():
            if len(set(row.values())) > 1:
                key = next(iter(row)).split("=", 1)[0]
                values = [o.split("=", 1)[1] for o in row]
                first = next(iter(row.values()))
                differ = sorted({SHARED_PARTS[k] for parts in row.values()
                                 for k, a, b in zip(SHARED_PARTS, parts, first, strict=True) if a != b})
                raise ValueError(f"grid {key}={','.join(values)}: its values render {', '.join(differ)} differently, "
                                 "but a job array runs one script for every point (only what the trainer reads may "
                                 f"vary); submit such points as separate jobs, one `submit ... {key}=<value>` each")
    raise ValueError(f"grid: the points {' / '.join(' '.join(p) for p in grid)} render the job script differently, "
                     "but a job array runs one script for every point; submit them as separate jobs")


def render(cfg, sub: Submission) -> str:
    """The batch script for `cfg` (a validated Config) under `sub`. What the trainer would refuse on the
    cluster's training ranks, or at any grid point, is an error here, before a job is queued. A grid's points
    must agree on what the job array's one script renders once (`SHARED_PARTS`)."""
    c = cfg.cluster
    cfg.check_world_size(c.training_gpus, c.describe_training_gpus())
    if not sub.grid:
        _check_engine_room(cfg)
        values = _values(cfg, sub)
    else:
        rendered = []
        for point in sub.grid:
            try:
                p = config_from_dict(apply_overrides(cfg.to_dict(), list(point)))
                p.check_world_size(p.cluster.training_gpus, p.cluster.describe_training_gpus())
                _check_engine_room(p)
                rendered.append(_values(p, sub))
            except ValueError as e:
                raise ValueError(f"grid point {' '.join(point)}: {e}") from None
        _check_grid_shares(sub.grid, rendered)
        # the points' script (the same for all); the watcher's estimate before a save is measured: the longest
        values = {**rendered[0], "CHECKPOINT_S": str(max(int(r["CHECKPOINT_S"]) for r in rendered))}
    text = (TEMPLATES / "train.sbatch").read_text()
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    if "{{" in text:
        raise ValueError(f"slurm/train.sbatch: unfilled placeholder near {text[text.index('{{'):][:40]!r}")
    return text


def write_job(cfg, sub: Submission) -> Path:
    """The resolved config, the batch script and the engine launcher under <run dir>/submit/; returns the script."""
    d = RunDir(sub.run_dir).submit
    d.mkdir(parents=True, exist_ok=True)
    RunDir(sub.run_dir).logs.mkdir(exist_ok=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (d / "engines.sh").write_text((TEMPLATES / "engines.sh").read_text())
    script = d / "train.sbatch"
    script.write_text(render(cfg, sub))
    script.chmod(0o755)
    return script


def sbatch(script: Path, *, dependency: str | None = None) -> str:
    """Submit; returns the job id (sbatch --parsable prints `id[;cluster]`)."""
    cmd = ["sbatch", "--parsable"] + ([f"--dependency={dependency}"] if dependency else []) + [str(script)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise RuntimeError(f"sbatch is not on PATH (no Slurm here?); the job is written to {script}, and --dry-run "
                           "prints it") from None
    if out.returncode:
        raise RuntimeError(f"sbatch failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]


def submit(cfg, sub: Submission, *, chain: int = 1) -> list[str]:
    """Write the job and submit it `chain` times, each job starting after the previous one ended (afterany): a
    long run continues from its checkpoints across wall-clock limits. Returns the job ids."""
    check_int("chain", chain)
    script = write_job(cfg, sub)
    ids: list[str] = []
    for _ in range(chain):
        ids.append(sbatch(script, dependency=f"afterany:{ids[-1]}" if ids else None))
    (RunDir(sub.run_dir).submit / "jobs.txt").write_text(
        "".join(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {j}\n" for j in ids))
    return ids
