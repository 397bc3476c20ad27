"""`megatron-pdm compare RUN_DIR...`: a table and plots across runs (reward, mismatch, masked fraction, entropy).

Reads each run's `config.yaml` and `metrics.jsonl` (as `megatron-pdm train` writes them). A run *collapses* when
its evaluation reward loses more than half of what it gained (`collapsed_eval`: some evaluation below
best - 0.5 x (best - base), best the highest evaluation so far, base the lower of 0 and the first evaluation; for
rewards >= 0, below half its best), or any logged value is NaN. The mismatch columns are
the step-start values (`mismatch_start/*`: the first minibatch, before the step's first update, so pi is the
policy mu sampled from up to precision), falling back to the whole step's `mismatch/*` for older runs. Runs of an
off-policy schedule (they log `mismatch_start/age0/*`) show the age-0 tokens' mismatch, the precision term, so
that lag is not read as precision ('-' where no token trained at age 0: a lagged run's are all older; its p99
column too, which is not split by age). `eval_auc` is the area under the evaluation curve over the steps it
spans (trapezoids), divided by that span: the mean evaluation reward over training.

With `over_seeds`, runs whose configs differ only in `train.seed` (and in what only says where and how the run ran,
`RUNTIME_ONLY`: the engine URLs a Slurm job passes, logging) form one row: each number is the mean over
the seeds (steps to target only when every seed reached it; collapse when any seed collapsed), and the plots
show the mean curve over the steps every seed logged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_pdm._jsonl import read_jsonl, write_atomic
from megatron_pdm._rundir import RunDir

# config keys that say where and how a run ran, not what it trains: left out when `over_seeds` groups runs by their
# config. The Slurm job passes the first three to every start (submit._rollout_block: its engines' URLs, their
# tensor-parallel size, colocated engines releasing memory); a bare section name is the whole section.
RUNTIME_ONLY = ("rollout.sglang.urls", "rollout.sglang.engine_tp", "rollout.sglang.release_memory", "logging")
PLOTS = (("eval/reward", "eval reward"), ("mismatch_start/kl_k3", "mismatch KL(mu||pi) at step start, k3 (age 0)"),
         ("mask/masked_frac", "masked fraction"), ("policy/entropy", "entropy"))


@dataclass
class Run:
    path: Path
    label: str
    rows: list[dict]
    config: dict | None = None

    def series(self, key):
        """(steps, values) of `key`; a mismatch_start/ key is the age-0 tokens' in off-policy runs (NaN when none;
        the p99 has no age split: none) and falls back to mismatch/ for runs that predate it."""
        if key.startswith("mismatch_start/") and any("mismatch_start/age0/kl_k3" in r for r in self.rows):
            key = "mismatch_start/age0/" + key.split("/", 1)[1]
            pts = [(r["step"], r[key]) for r in self.rows if key in r and not math.isnan(r[key])]
            return [p[0] for p in pts], [p[1] for p in pts]
        if key.startswith("mismatch_start/") and not any(key in r for r in self.rows):
            key = "mismatch/" + key.split("/", 1)[1]
        pts = [(r["step"], r[key]) for r in self.rows if key in r]
        return [p[0] for p in pts], [p[1] for p in pts]


def load_run(path) -> Run:
    path = Path(path)
    metrics, config = RunDir(path).metrics, RunDir(path).config
    if not metrics.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (not a megatron-pdm run directory?)")
    rows = []
    for lineno, row in read_jsonl(metrics):
        if not isinstance(row, dict) or "step" not in row:
            raise ValueError(f"{metrics}:{lineno}: missing field 'step'")
        rows.append({k: (float("nan") if v is None else v) for k, v in row.items()})
    label, cfg = path.name, None
    if config.is_file():
        cfg = yaml.safe_load(config.read_text()) or {}
        label = f"{path.name} {_setting(cfg)}"
    return Run(path, label, rows, cfg)


def _setting(cfg: dict) -> str:
    precision = cfg.get("precision", {})
    train = precision.get("train", "fp32")
    return (f"[{cfg.get('objective', {}).get('mask', '?')}, "
            f"rollout {precision.get('rollout') or cfg.get('rollout', {}).get('dtype', '?')}"
            f"{'' if train == 'fp32' else ', train ' + train}]")


def setting_key(config: dict) -> str:
    """A run's setting: its config without train.seed and the RUNTIME_ONLY keys, as one comparable string."""
    drop = {"train.seed", *RUNTIME_ONLY}

    def kept(values, path: str):  # the values under `path` without the dropped keys, in sub-sections too
        return values if not isinstance(values, dict) else \
            {k: kept(v, f"{path}.{k}") for k, v in values.items() if f"{path}.{k}" not in drop}

    return json.dumps({s: kept(v, s) for s, v in config.items() if s not in drop}, sort_keys=True, default=str)


def group_over_seeds(runs: list[Run]) -> list[list[Run]]:
    """Runs grouped by their setting (`setting_key`: the config without train.seed and RUNTIME_ONLY), in order of
    first appearance."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        if run.config is None:
            raise ValueError(f"{run.path}: no config.yaml, so its seed cannot be told apart from its setting")
        groups.setdefault(setting_key(run.config), []).append(run)
    return list(groups.values())


def _seed_mean(runs: list[Run]) -> Run:
    """A run whose rows hold, at every step all runs logged, the mean of each key all of them logged there."""
    by_step = [{r["step"]: r for r in run.rows} for run in runs]
    rows = []
    for step in sorted(set.intersection(*(set(b) for b in by_step))):
        keys = set.intersection(*(set(b[step]) for b in by_step))
        rows.append({k: sum(b[step][k] for b in by_step) / len(by_step) for k in keys
                     if all(isinstance(b[step][k], (int, float)) for b in by_step)})
    return Run(runs[0].path, _seeds_label(runs), rows, runs[0].config)


def _seeds_label(runs: list[Run]) -> str:
    seeds = ", ".join(str(r.config.get("train", {}).get("seed", "?")) for r in runs)
    return f"{_setting(runs[0].config)} seeds {seeds}"


def summarize_seeds(runs: list[Run], *, target: float | None = None) -> dict:
    """summarize() of each run, then the mean over runs (None when any run has None)."""
    each = [summarize(r, target=target) for r in runs]
    row = {"run": _seeds_label(runs), "seeds": [r.config.get("train", {}).get("seed") for r in runs]}
    for key in ("final_eval_reward", "best_eval_reward", "eval_auc", "steps_to_target", "mean_mismatch_kl",
                "mean_mismatch_p99", "mean_masked_frac"):
        vals = [e[key] for e in each]
        row[key] = None if any(v is None for v in vals) else sum(vals) / len(vals)
    row["collapsed"] = any(e["collapsed"] for e in each)
    row["per_seed"] = each
    return row


def _mean(xs):
    """The mean of the finite values; None (null in compare.json, '-' in the table) when the run logged none."""
    xs = [x for x in xs if isinstance(x, (int, float)) and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def _fmt(value, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def collapsed_eval(rewards: list[float]) -> bool:
    """Whether an evaluation curve collapsed: some value lost more than half of what the run had gained, i.e. fell
    below best - 0.5 x (best - base), with best the highest value up to it and base the lower of 0 and the first
    value, where best > base (a gain to lose). For rewards >= 0 (base 0) that is below half the best so far; for
    negative rewards the first evaluation is the base, so an improving run (-0.8, -0.5, -0.2) has not collapsed and
    one that gives back most of its gain (-0.8, -0.2, -0.6) has."""
    if not rewards:
        return False
    base, best = min(0.0, rewards[0]), rewards[0]
    for r in rewards:
        best = max(best, r)
        if best > base and r < best - 0.5 * (best - base):
            return True
    return False


def summarize(run: Run, *, target: float | None = None) -> dict:
    _, reward = run.series("eval/reward")
    steps, _ = run.series("eval/reward")
    finite = [r for r in reward if not math.isnan(r)]
    best = max(finite) if finite else float("nan")
    nan_seen = any(isinstance(v, float) and math.isnan(v) for r in run.rows for k, v in r.items()
                   if k.startswith(("train/", "eval/")))
    dropped = collapsed_eval(finite)
    reached = next((s for s, r in zip(steps, reward, strict=True) if target is not None and r >= target), None)
    return {
        "run": run.label,
        "final_eval_reward": reward[-1] if reward else float("nan"),
        "best_eval_reward": best,
        "eval_auc": _auc(steps, reward),
        "steps_to_target": reached,
        "mean_mismatch_kl": _mean(run.series("mismatch_start/kl_k3")[1]),
        "mean_mismatch_p99": _mean(run.series("mismatch_start/abs_log_ratio_p99")[1]),
        "mean_masked_frac": _mean(run.series("mask/masked_frac")[1]),
        "collapsed": bool(nan_seen or dropped),
    }


def _auc(steps, values) -> float:
    """The mean of a curve over the steps it spans (trapezoids / span; the one value for a single point)."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    area = sum((b - a) * (x + y) / 2 for a, b, x, y in zip(steps, steps[1:], values, values[1:], strict=False))
    return area / (steps[-1] - steps[0])


def format_table(rows: list[dict], target) -> str:
    w = max([3, *(len(r["run"]) for r in rows)])
    head = (f"{'run':<{w}} {'final':>6} {'best':>6} {'auc':>6} {'steps to ' + str(target):>14} {'KL(mu|pi)':>9} "
            f"{'|dlogp|99':>9} {'masked':>8} {'collapse':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        to = "-" if r["steps_to_target"] is None else f"{r['steps_to_target']:g}"
        lines.append(f"{r['run']:<{w}} {r['final_eval_reward']:>6.3f} {r['best_eval_reward']:>6.3f} "
                     f"{r['eval_auc']:>6.3f} {to:>14} "
                     f"{_fmt(r['mean_mismatch_kl'], '.2e', 9)} {_fmt(r['mean_mismatch_p99'], '.2e', 9)} "
                     f"{_fmt(r['mean_masked_frac'], '.4f', 8)} "
                     f"{'YES' if r['collapsed'] else 'no':>8}")
    return "\n".join(lines)


def _smooth(values, window: int):
    """Trailing moving average (per-step series are noisy at a few hundred tokens per step)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def _styles(runs: list[Run]) -> list[dict]:
    """One colour per mask and one line style per rollout precision when the configs say them, so that a
    3 x 3 grid reads at a glance; else one colour per run."""
    keys = [(_get(r.config, "objective", "mask"), _get(r.config, "precision", "rollout")) for r in runs]
    if any(k[0] is None for k in keys) or len(set(keys)) < len(keys):
        return [{"color": f"C{i % 10}"} for i in range(len(runs))]
    masks, precisions = sorted({k[0] for k in keys}), sorted({str(k[1]) for k in keys})
    dashes = ["-", "--", ":", "-."]
    return [{"color": f"C{masks.index(m) % 10}", "linestyle": dashes[precisions.index(str(p)) % 4]} for m, p in keys]


def _get(cfg, section, key):
    return (cfg or {}).get(section, {}).get(key)


def plot(runs: list[Run], path: Path, *, smooth: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PLOTS), figsize=(4.5 * len(PLOTS), 4))
    for ax, (key, title) in zip(axes, PLOTS, strict=True):
        for run, style in zip(runs, _styles(runs), strict=True):
            steps, values = run.series(key)
            if key == "eval/reward":
                ax.plot(steps, values, marker="o", ms=3, label=run.label, **style)
            else:
                ax.plot(steps, _smooth(values, smooth), label=run.label, **style)
        ax.set_title(title if key == "eval/reward" else f"{title} (mean of {smooth} steps)", fontsize=9)
        if key.startswith("mismatch"):
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare(run_dirs, *, out_dir, target: float | None = None, over_seeds: bool = False) -> list[dict]:
    runs = [load_run(d) for d in run_dirs]
    if over_seeds:
        groups = group_over_seeds(runs)
        rows = [summarize_seeds(g, target=target) for g in groups]
        runs = [_seed_mean(g) for g in groups]
    else:
        rows = [summarize(r, target=target) for r in runs]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "compare.json", json.dumps(rows, indent=2) + "\n")  # a rerun replaces it whole
    plot(runs, out_dir / "compare.png")
    return rows
