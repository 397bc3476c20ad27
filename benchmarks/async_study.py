"""The staleness study: rollout lag x mask x paired seeds on the arithmetic task with a bf16 rollout.

    python benchmarks/async_study.py --run-root runs/async_study --lags 0,1,2,4 --masks ppo,dppo,pdm \
        --seeds 1,2,3,4,5,6,7,8 [override ...]

Runs the grid through `megatron-pdm sweep`, seed by seed (every setting of seed 1, then of seed 2, ...: a grid
stopped early holds whole seeds; resumable: finished runs are skipped; `--no-run` only reads them),
then prints one row per (lag, mask), the means over seeds of: the area under the eval curve (`eval_auc`, the mean
eval reward over training), the final and best eval reward, collapses (compare's rule), the masked fraction, and
the step-start outside fraction (D > delta before any update) of the tokens at the run's lag; and paired
bootstrap 95% intervals (over seeds, 10,000 resamples, a seeded generator) of two differences of eval_auc: each
setting against the same mask at lag 0, and each mask against ppo at the same lag. Writes summary.json under
the run root (and `--json` where given).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_pdm.cluster.compare import load_run, summarize  # noqa: E402
from megatron_pdm.cluster.sweep import point_name  # noqa: E402


def bootstrap(diffs: list[float], *, resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean paired difference and its 95% percentile bootstrap interval over seeds."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(resamples))
    return statistics.fmean(diffs), means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def outside_at_age(run, age: int) -> float | None:
    """The mean over steps of divergence_start/age{age}/outside_frac (the sync schedule logs no ages: the
    all-token step-start value, the first minibatch's divergence/outside_frac, is not logged; None)."""
    key = f"divergence_start/age{min(age, 3)}{'+' if age >= 3 else ''}/outside_frac"
    vals = [r[key] for r in run.rows if key in r and not math.isnan(r[key])]
    return statistics.fmean(vals) if vals else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "tiny_cpu.yaml"))
    ap.add_argument("--run-root", type=Path, default=ROOT / "runs" / "async_study")
    ap.add_argument("--lags", default="0,1,2,4")
    ap.add_argument("--masks", default="ppo,dppo,pdm")
    ap.add_argument("--seeds", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--no-run", action="store_true", help="only summarize the runs already under --run-root")
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time (each then on one intra-op thread)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="section.key=value for every run (e.g. optim.lr=3e-3)")
    args = ap.parse_args(argv)
    lags, masks, seeds = (s.split(",") for s in (args.lags, args.masks, args.seeds))
    base = ["rollout.schedule=lagged", "precision.rollout=bf16", *args.overrides]
    if not args.no_run:
        env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if args.parallel > 1 else {})}
        subprocess.run([sys.executable, "-m", "megatron_pdm.cli", "sweep", "--config", args.config, "--run-root",
                        str(args.run_root), "--parallel", str(args.parallel), *base, "--grid",
                        f"train.seed={args.seeds}", f"rollout.lag={args.lags}", f"objective.mask={args.masks}"],
                       check=True, cwd=ROOT, env=env)
    runs = {(lag, mask, seed): load_run(args.run_root / point_name((f"train.seed={seed}", f"rollout.lag={lag}",
                                                                    f"objective.mask={mask}")))
            for lag in lags for mask in masks for seed in seeds}
    summ = {k: summarize(r) for k, r in runs.items()}
    rows = []
    for lag in lags:
        for mask in masks:
            per = [summ[(lag, mask, s)] for s in seeds]
            auc = [p["eval_auc"] for p in per]
            outside = [outside_at_age(runs[(lag, mask, s)], int(lag)) for s in seeds]
            row = {"lag": int(lag), "mask": mask, "eval_auc": statistics.fmean(auc),
                   "final": statistics.fmean(p["final_eval_reward"] for p in per),
                   "best": statistics.fmean(p["best_eval_reward"] for p in per),
                   "collapses": sum(p["collapsed"] for p in per),
                   "masked_frac": statistics.fmean(p["mean_masked_frac"] for p in per),
                   "outside_frac_at_lag": None if None in outside else statistics.fmean(outside),
                   "auc_per_seed": auc}
            if lag != lags[0]:
                row["auc_vs_lag0"] = bootstrap([a - summ[(lags[0], mask, s)]["eval_auc"] for a, s in
                                                zip(auc, seeds, strict=True)])
            if mask != "ppo" and "ppo" in masks:
                row["auc_vs_ppo"] = bootstrap([a - summ[(lag, "ppo", s)]["eval_auc"] for a, s in
                                               zip(auc, seeds, strict=True)])
            rows.append(row)
    ci = lambda t: "-" if t is None else f"{t[0]:+.3f} [{t[1]:+.3f}, {t[2]:+.3f}]"  # noqa: E731
    print(f"{len(seeds)} paired seeds; overrides: {' '.join(base)}")
    print("| lag | mask | eval AUC | final | best | collapses | masked | outside at lag | AUC - lag 0 [95% CI] | "
          "AUC - ppo [95% CI] |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        out = "-" if r["outside_frac_at_lag"] is None else f"{r['outside_frac_at_lag']:.3f}"
        print(f"| {r['lag']} | {r['mask']} | {r['eval_auc']:.3f} | {r['final']:.3f} | {r['best']:.3f} | "
              f"{r['collapses']}/{len(seeds)} | {r['masked_frac']:.4f} | {out} | {ci(r.get('auc_vs_lag0'))} | "
              f"{ci(r.get('auc_vs_ppo'))} |")
    import torch
    from host import host_info

    result = {"seeds": seeds, "overrides": base, "rows": rows,
              "host": host_info(1 if args.parallel > 1 else torch.get_num_threads())}
    (args.run_root / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
