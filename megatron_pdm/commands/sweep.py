"""`megatron-pdm sweep` (the grid runner: cluster/sweep.py; --slurm hands the grid to `submit`)."""

from __future__ import annotations

import argparse
import sys

from megatron_pdm.commands import EPILOG, input_errors, parse, refuse
from megatron_pdm.commands import submit as submit_command


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("sweep", help=run.__doc__, epilog=EPILOG)
    p.add_argument("--config", help="YAML config, as for train")
    p.add_argument("--grid", nargs="+", required=True, metavar="KEY=V1,V2",
                   help="axes of the sweep; every combination of their values is one run")
    p.add_argument("--run-root", help="one run directory per point under it (default runs/sweep-<config name>)")
    p.add_argument("--parallel", type=int, default=1, help="local runs at a time")
    p.add_argument("--nproc", type=int, help="processes per local run (default TP x PP x CP x EP)")
    p.add_argument("--target", type=float, default=0.5, help="eval reward whose first reach compare reports")
    p.add_argument("--slurm", action="store_true",
                   help="submit the grid as one Slurm job array instead (axes the trainer alone reads: an axis that "
                        "changes the engines or the #SBATCH header, e.g. precision.rollout, is refused)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides for every point (before --grid)")
    p.set_defaults(func=run)


def run(args) -> int:
    """Run a grid of overrides (e.g. precision.rollout=bf16,fp16,fp8 objective.mask=ppo,dppo,pdm), one run
    directory per point, locally then `compare`, or as one Slurm job array (--slurm: only axes the trainer alone
    reads, e.g. objective.mask or train.seed; precision.rollout, cluster.* and other axes that change the engines
    or the #SBATCH header are refused: submit their values as separate jobs)."""
    from pathlib import Path

    from megatron_pdm.cluster.compare import compare, format_table
    from megatron_pdm.cluster.sweep import sweep_local

    root = Path(args.run_root or Path("runs") / f"sweep-{Path(args.config or 'default').stem}")
    if args.slurm:
        if not args.config:
            print("sweep --slurm: --config is required (submit renders it into the job)", file=sys.stderr)
            return 2
        parser = argparse.ArgumentParser(prog="megatron-pdm")  # `submit`'s own flags and checks, as if typed
        submit_command.add_parser(parser.add_subparsers(dest="command", required=True))
        return submit_command.run(parse(parser, ["submit", args.config, "--run-dir", str(root), *args.overrides,
                                                 "--grid", *args.grid]))
    try:  # a grid point's config is loaded before any run starts; a run's own failure is in its train.log
        done, failed = sweep_local(args.config, args.grid, run_root=root, overrides=args.overrides,
                                   parallel=args.parallel, nproc=args.nproc)
        if done:
            seeds = any(axis.split("=", 1)[0] == "train.seed" for axis in args.grid)  # repeats, not settings
            rows = compare(done, out_dir=root / "compare", target=args.target, over_seeds=seeds)
            print(format_table(rows, args.target))
            print(f"wrote {root / 'compare' / 'compare.json'} and {root / 'compare' / 'compare.png'}")
    except input_errors() as e:
        return refuse("sweep", e)
    return 1 if failed else 0
