"""`megatron-pdm submit` (the Slurm rendering: cluster/submit.py)."""

from __future__ import annotations

import json
import sys

from megatron_pdm.commands import EPILOG


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("submit", help=run.__doc__, epilog=EPILOG)
    p.add_argument("config", help="YAML config; its cluster section gives the defaults of the options below")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (processes per node with --gpu cpu)")
    p.add_argument("--gpu", choices=["h100", "h200", "b200", "cpu"])
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--time", help="wall-clock limit, Slurm format (e.g. 04:00:00)")
    p.add_argument("--container-image", help="run every step in this container (pyxis / enroot)")
    p.add_argument("--container-mounts")
    p.add_argument("--run-dir", help="default runs/<config name>-<time>")
    p.add_argument("--launcher", choices=["torchrun", "srun"], default="torchrun",
                   help="torchrun: one per node, c10d rendezvous on the first node; srun: one task per rank")
    p.add_argument("--grid", nargs="*", default=[], metavar="KEY=V1,V2",
                   help="a sweep as a job array: every combination of the values, one run directory each (axes the "
                        "trainer alone reads; one that changes the engines or the #SBATCH header is refused)")
    p.add_argument("--chain", type=int, default=1, help="submit N jobs, each after the previous one ended")
    p.add_argument("--signal", type=int,
                   help="seconds before the time limit to checkpoint and requeue (cluster.stop_warning_s; default: "
                        "derived from the run's measured step time, 2 x a step plus the checkpoint time)")
    p.add_argument("--router", action="store_true", help="start sglang-router in front of the engines")
    p.add_argument("--sbatch-arg", action="append", default=[], help="one sbatch option, e.g. --qos=high")
    p.add_argument("--force", action="store_true", help="submit even when `plan` says it does not fit")
    p.add_argument("--dry-run", action="store_true", help="print the batch script; submit nothing")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.set_defaults(func=run)


def run(args) -> int:
    """Render the Slurm batch script for a config (training ranks, SGLang engines, requeue on the time limit) and
    submit it; --dry-run prints it instead."""
    import time
    from pathlib import Path

    import yaml

    from megatron_pdm.cluster.plan import format_plan, load_plan_config, plan
    from megatron_pdm.cluster.submit import Submission, expand_grid, render, stop_warning_s, submit

    flags = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "gpu": args.gpu, "partition": args.partition,
             "account": args.account, "time": args.time, "container_image": args.container_image,
             "container_mounts": args.container_mounts, "stop_warning_s": args.signal}
    overrides = [f"cluster.{k}={json.dumps(v)}" for k, v in flags.items() if v is not None] + list(args.overrides)
    note = []
    try:  # a config, a layout, a grid or a script that cannot be rendered: say why, no traceback
        cfg = load_plan_config(args.config, overrides, notes=note)  # uneven pipeline stages filled in, as in `plan`
        for x in note:
            print(f"submit: {x}", file=sys.stderr)
        note = []
        run_dir = Path(args.run_dir or Path("runs") / f"{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
        sub = Submission(run_dir=run_dir.resolve(), launcher=args.launcher, grid=expand_grid(args.grid),
                         signal_s=stop_warning_s(cfg, run_dir.resolve()), router=args.router,
                         sbatch_args=tuple(args.sbatch_arg))
        if cfg.cluster.gpu != "cpu" and not args.force:
            p = plan(cfg)
            if not p.fits:
                print(format_plan(p), file=sys.stderr)
                print("submit: the plan does not fit (see above); --force submits anyway", file=sys.stderr)
                return 1
        if args.dry_run:
            print(render(cfg, sub))
            return 0
        ids = submit(cfg, sub, chain=args.chain)
    except (ValueError, FileNotFoundError, yaml.YAMLError) as e:
        print("\n".join(f"submit: {x}" for x in [*note, e]), file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:  # sbatch failed, or the run directory cannot be written
        print(f"submit: {e}", file=sys.stderr)
        return 1
    print(f"submitted job {' '.join(ids)}; run directory {run_dir}; script {run_dir / 'submit' / 'train.sbatch'}")
    return 0
