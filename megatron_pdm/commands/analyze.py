"""`megatron-pdm analyze` (the study itself: train/analyze.py)."""

from __future__ import annotations

import sys

from megatron_pdm.commands import EPILOG, input_errors, refuse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("analyze", help=run.__doc__, epilog=EPILOG)
    p.add_argument("--config", help="YAML config, as for train")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--rollouts", type=int, default=256, help="responses per seed")
    p.add_argument("--pre-updates", default="1",
                   help="optimizer steps on the rollouts before the measured one (the policy drifts from mu); a "
                        "list such as 1,2,4,8 measures each from the same rollouts")
    p.add_argument("--out-dir", help="where analysis.json and analysis.png go (a study there is resumed)")
    p.add_argument("--nproc", type=int, help="local processes to spawn (default TP x PP x CP x EP)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.set_defaults(func=run)


def run(args) -> int:
    """The token-level alignment study: unsafe / corrective keeps of the ratio and PDM direction rules."""
    from pathlib import Path

    from megatron_pdm._validate import check_int
    from megatron_pdm.train.analyze import (
        check_layout,
        check_objective,
        check_rollouts,
        finished_seeds,
        pre_update_counts,
        study_identity,
    )
    from megatron_pdm.train.config import load_config
    from megatron_pdm.train.launch import analyze_job, launch, local_world

    out = Path(args.out_dir) if args.out_dir else Path("runs") / f"analyze-{Path(args.config or 'default').stem}"
    try:  # every input error before any process starts; one a rank raises comes back from `launch` the same way
        check_int("--seeds", args.seeds)  # (an empty study divided by zero seeds at its end)
        pre_updates = pre_update_counts(args.pre_updates)
        cfg = load_config(args.config, args.overrides)
        check_rollouts(args.rollouts, cfg.rollout.n)
        check_objective(cfg.objective)
        finished = finished_seeds(out, study_identity(cfg, args.rollouts, pre_updates))  # a study there: resumed
        if finished:
            print(f"resuming the study in {out}: {len(finished)} seed(s) done", file=sys.stderr)
        world = local_world(cfg, args.nproc)
        if world is not None:
            check_layout(cfg.parallel, cfg.check_world_size(world, f"{world} processes"))
        launch(analyze_job, (cfg, str(out), args.seeds, args.rollouts, pre_updates), cfg, nproc=args.nproc,
               lock=out)
    except input_errors() as e:
        return refuse("analyze", e)
    print(f"wrote {out / 'analysis.json'} and {out / 'analysis.png'}")
    return 0
