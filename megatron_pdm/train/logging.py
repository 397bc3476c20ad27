"""The run directory: resolved config, metrics.jsonl, TensorBoard events (and wandb when asked), a progress bar,
and a PNG at the end."""

from __future__ import annotations

import json
import logging
import math
import secrets
from pathlib import Path

import yaml

from megatron_pdm._jsonl import write_atomic
from megatron_pdm._rundir import RunDir
from megatron_pdm._validate import is_int

log = logging.getLogger(__name__)


class RunLogger:
    """Writes on rank 0 only (enabled=False elsewhere: every method is then a no-op)."""

    def __init__(self, run_dir: Path, cfg, *, enabled: bool):
        self.run_dir, self.enabled, self.rows = Path(run_dir), enabled, []
        self.cfg = cfg
        self._tb = self._progress = self._wandb = None
        if not enabled:
            return
        # no file is written yet: a run that refuses to start (an earlier run's checkpoints, a failed resume)
        # leaves the directory as it found it; config.yaml is written by `truncate`, once the run goes ahead
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = RunDir(self.run_dir).metrics
        if self.metrics_path.exists():
            self.rows = read_metrics(self.metrics_path)

    def write_config(self) -> None:
        """The resolved config as <run dir>/config.yaml, replaced whole (a resume rewrites it)."""
        if self.enabled:
            write_atomic(RunDir(self.run_dir).config, yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))

    def truncate(self, *, after_step: int) -> None:
        """The run starts (after_step -1) or resumes from the checkpoint of after_step: the trainer calls this once
        the run is known to go ahead. Writes config.yaml and drops the rows past after_step (a resumed run
        recomputes them, identically). Both files are replaced whole: a kill meanwhile leaves the old or the new."""
        if not self.enabled:
            return
        self.write_config()
        self.rows = [r for r in self.rows if r["step"] <= after_step]
        write_atomic(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.rows))

    def start(self, *, total: int, done: int) -> None:
        if not self.enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(str(RunDir(self.run_dir).tensorboard))
        if self.cfg.logging.wandb:
            self._wandb = self._start_wandb()
        self._progress = Progress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                  TextColumn("{task.fields[info]}"))
        self._progress.start()
        self._task = self._progress.add_task("train", total=total, completed=done, info="")

    def _start_wandb(self):
        """One wandb run per run directory: its id is kept in the directory, so a resumed run continues it."""
        import wandb

        w = self.cfg.logging
        id_file = self.run_dir / "wandb_id"
        if not id_file.exists():  # whole or absent: a kill while it was written would leave an empty id
            write_atomic(id_file, secrets.token_hex(8) + "\n")
        run = wandb.init(project=w.wandb_project, name=w.wandb_name or self.run_dir.name, group=w.wandb_group,
                         dir=str(self.run_dir), config=self.cfg.to_dict(), mode=w.wandb_mode,
                         id=id_file.read_text().strip(), resume="allow")
        # the RL step is a logged field, not wandb's own step: a resumed run logs again the steps after its
        # checkpoint, which wandb's monotonic step would drop
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return run

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.rows.append(row)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, row["step"])
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if v is not None})
        if self._progress is not None and "train/reward" in row:
            info = (f"reward {row['train/reward']:.3f}  masked {row.get('mask/masked_frac') or 0:.4f}  "
                    f"{row['perf/tokens_per_s']:.0f} tok/s")
            if row.get("eval/reward") is not None:
                info += f"  eval {row['eval/reward']:.3f}"
            self._progress.update(self._task, completed=row["step"], info=info)

    def finish(self) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        plot_run(self.rows, RunDir(self.run_dir).plot)


def plot_run(rows: list[dict], path: Path) -> None:
    """Reward (train and eval) and the mask diagnostics against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("train/reward", "-"), ("eval/reward", "o-")):
        a.plot(*series(key), style, label=key)
    a.set_xlabel("step")
    a.set_ylabel("reward")
    a.legend()
    a.grid(alpha=0.3)
    for key in ("mask/masked_frac", "mask/outside_frac", "mask/direction_disagree_frac", "divergence/mean"):
        b.plot(*series(key), label=key)
    b.set_xlabel("step")
    b.set_yscale("symlog", linthresh=1e-4)
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl; a last line cut short (a kill while it was written) is dropped with a log line
    (the resumed run logs that step again); a bad line elsewhere, or one that is JSON but not a row (an object with
    an integer step), is an error naming the file and the line."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError as e:
            if i + 1 < len(lines):
                raise ValueError(f"{path}: line {i + 1} is not JSON ({e})") from None
            log.warning("%s: the last line is cut short (%s): dropped", path, e)
            continue
        if not isinstance(row, dict) or not is_int(row.get("step")):
            raise ValueError(f"{path}: line {i + 1} is not a metrics row (an object with an integer 'step'): "
                             f"{line[:60]!r}")
        rows.append(row)
    return rows
