"""A run directory's layout, its one home: every module that reads or writes a run's files (trainer, logger,
checkpoints, engines, submit, sweep, compare) asks `RunDir` where they are.

    <run dir>/
      config.yaml        the resolved config (written when the run goes ahead)
      metrics.jsonl      one JSON row per step (step 0: the evaluation before training)
      plot.png           the logger's plot;  tensorboard/  its event files
      checkpoints/       step_XXXXXXXX/ (published by a rename; train/checkpoint.py)
      weights/           HF exports for engines that load from disk (rollout.weight_sync disk; rollout.weight_dir)
      logs/              launched engines' and the Slurm job's logs
      submit/            what `megatron-pdm submit` wrote: config.yaml, train.sbatch, engines.sh
      STOP_AND_CHECKPOINT  the job script asks for a checkpoint and a stop (Slurm's pre-timeout signal)
      REQUEUE            the trainer asks the job script to requeue (written after that checkpoint)

An `analyze` directory holds config.yaml and:
      study.json         what the study measures (config, rollouts per seed, pre-update counts): a rerun resumes it
      seeds.jsonl        one row per (seed, pre-update count), appended as each seed finishes
      analysis.json      the summary and every row;  analysis.png  the per-seed scatter
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STOP_FILE = "STOP_AND_CHECKPOINT"
REQUEUE_FILE = "REQUEUE"


def _entry(name: str) -> property:
    return property(lambda self: self.path / name, doc=f"<run dir>/{name}")


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __init__(self, path):
        object.__setattr__(self, "path", Path(path))

    config = _entry("config.yaml")
    metrics = _entry("metrics.jsonl")
    plot = _entry("plot.png")
    tensorboard = _entry("tensorboard")
    checkpoints = _entry("checkpoints")
    weights = _entry("weights")
    logs = _entry("logs")
    submit = _entry("submit")
    stop_file = _entry(STOP_FILE)
    requeue_file = _entry(REQUEUE_FILE)
    study = _entry("study.json")
    study_seeds = _entry("seeds.jsonl")
    analysis = _entry("analysis.json")
    analysis_plot = _entry("analysis.png")
