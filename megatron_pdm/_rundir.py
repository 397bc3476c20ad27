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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STOP_FILE = "STOP_AND_CHECKPOINT"
REQUEUE_FILE = "REQUEUE"


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __init__(self, path):
        object.__setattr__(self, "path", Path(path))

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def plot(self) -> Path:
        return self.path / "plot.png"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def weights(self) -> Path:
        return self.path / "weights"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def submit(self) -> Path:
        return self.path / "submit"

    @property
    def stop_file(self) -> Path:
        return self.path / STOP_FILE

    @property
    def requeue_file(self) -> Path:
        return self.path / REQUEUE_FILE
