"""`megatron-pdm sweep`: every combination of a grid of overrides, one run directory each, then `compare`.

Locally the runs are `megatron-pdm train` subprocesses, `parallel` at a time, each with `--auto-resume`, so a
sweep that was interrupted continues where each run stopped; a run whose last step is checkpointed is not started
again. On Slurm the same grid is one job array
(`megatron-pdm submit --grid`), for axes the trainer alone reads (submit refuses one that changes the engines or
the #SBATCH header, such as precision.rollout). Either way a point's run directory is named after its overrides
(`objective.mask-pdm_precision.rollout-fp8`), as the batch script names it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from megatron_pdm._rundir import RunDir
from megatron_pdm.cluster.submit import expand_grid
from megatron_pdm.train.checkpoint import latest_checkpoint, read_trainer_state
from megatron_pdm.train.config import load_config


def point_name(point: tuple[str, ...]) -> str:
    """('objective.mask=pdm', 'precision.rollout=fp8') -> 'objective.mask-pdm_precision.rollout-fp8'."""
    return "_".join(o.replace("=", "-") for o in point)


def sweep_local(config: str | None, grid: list[str], *, run_root: Path, overrides: list[str] = (),
                parallel: int = 1, nproc: int | None = None) -> tuple[list[Path], list[Path]]:
    """Run every grid point to completion; returns (finished run dirs, failed run dirs). Each point's config is
    loaded before anything starts, so a bad value fails the sweep at once, naming the field."""
    if parallel < 1:
        raise ValueError(f"parallel: {parallel} must be >= 1")
    points = expand_grid(grid)
    if not points:
        raise ValueError("grid: give at least one section.key=v1,v2,... axis")
    steps = {point: load_config(config, [*overrides, *point]).train.steps for point in points}
    run_root.mkdir(parents=True, exist_ok=True)
    todo = [(point, run_root / point_name(point)) for point in points]
    running: list[tuple[subprocess.Popen, Path, float]] = []
    done, failed = [], []
    while todo or running:
        while todo and len(running) < parallel:
            point, run_dir = todo.pop(0)
            last = latest_checkpoint(RunDir(run_dir).checkpoints)
            if last is not None and read_trainer_state(last)["step"] >= steps[point]:  # nothing left to train
                done.append(run_dir)
                print(f"sweep: {run_dir.name} already finished", flush=True)
                continue
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "megatron_pdm.cli", "train", "--run-dir", str(run_dir), "--auto-resume",
                   *(["--config", config] if config else []), *(["--nproc", str(nproc)] if nproc else []),
                   *overrides, *point]
            with open(run_dir / "train.log", "ab") as log:
                running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), run_dir,
                                time.perf_counter()))
            print(f"sweep: started {run_dir.name}", flush=True)
        time.sleep(0.5)
        for proc, run_dir, t0 in [r for r in running if r[0].poll() is not None]:
            running.remove((proc, run_dir, t0))
            ok = proc.returncode == 0
            (done if ok else failed).append(run_dir)
            print(f"sweep: {run_dir.name} {'finished' if ok else f'FAILED (exit {proc.returncode})'} in "
                  f"{time.perf_counter() - t0:.0f} s" + ("" if ok else f"; see {run_dir / 'train.log'}"), flush=True)
    order = {run_root / point_name(p): i for i, p in enumerate(points)}
    return sorted(done, key=order.get), sorted(failed, key=order.get)
