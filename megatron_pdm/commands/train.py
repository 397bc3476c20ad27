"""`megatron-pdm train`."""

from __future__ import annotations

import os

from megatron_pdm.commands import EPILOG, input_errors, refuse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help=run.__doc__, epilog=EPILOG)
    p.add_argument("--config", help="YAML config (sections: model, parallel, objective, data, rollout, optim, train)")
    p.add_argument("--run-dir", help="where metrics, checkpoints and plots go (default runs/<config name>)")
    resume = p.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint in --run-dir")
    resume.add_argument("--auto-resume", action="store_true",
                        help="continue from the last complete checkpoint if there is one, else start (Slurm jobs)")
    p.add_argument("--nproc", type=int, help="local processes to spawn (default TP x PP x CP x EP)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. objective.mask=dppo")
    p.set_defaults(func=run)


def run(args) -> int:
    """Run RL training (GRPO-style with PPO / DPPO / PDM masks) from a YAML config."""
    from pathlib import Path

    from megatron_pdm.train.checkpoint import check_run_dir
    from megatron_pdm.train.config import load_config
    from megatron_pdm.train.data import load_rl_data
    from megatron_pdm.train.launch import launch, local_world, train_job

    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / Path(args.config or "default").stem
    resume = "auto" if args.auto_resume else args.resume
    try:  # every input error before any process starts; one a rank raises comes back from `launch` the same way
        cfg = load_config(args.config, args.overrides)
        data = load_rl_data(cfg)  # tokenizer and datasets
        world = local_world(cfg, args.nproc)
        if args.nproc and world is not None:
            cfg.check_world_size(world, f"--nproc {world}")
        check_run_dir(run_dir, resume)
        launch(train_job, (cfg, str(run_dir), resume, data), cfg, nproc=args.nproc, lock=run_dir)
    except input_errors() as e:
        return refuse("train", e)
    if os.environ.get("RANK", "0") == "0":  # under torchrun / srun every rank runs this command
        print(f"run directory: {run_dir}")
    return 0
