"""`megatron-pdm` command line."""

from __future__ import annotations

import argparse
import platform
import sys
from importlib import metadata


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def cmd_env(args) -> int:
    """Print the versions and accelerators this installation sees."""
    import torch

    import megatron_pdm

    rows = [
        ("megatron-pdm", megatron_pdm.__version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("cuda available", str(torch.cuda.is_available())),
        ("megatron-core", _version("megatron-core")),
        ("transformer-engine", _version("transformer-engine")),
        ("triton", _version("triton")),
        ("sglang", _version("sglang")),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def cmd_train(args) -> int:
    """Run RL training (GRPO-style with PPO / DPPO / PDM masks) from a YAML config."""
    from pathlib import Path

    from megatron_pdm.train.config import load_config
    from megatron_pdm.train.launch import launch, train_job

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / Path(args.config or "default").stem
    launch(train_job, (cfg, str(run_dir), args.resume), cfg, nproc=args.nproc)
    print(f"run directory: {run_dir}")
    return 0


def cmd_analyze(args) -> int:
    """The token-level alignment study: unsafe / corrective keeps of the ratio and PDM direction rules."""
    from pathlib import Path

    from megatron_pdm.train.config import load_config
    from megatron_pdm.train.launch import analyze_job, launch

    cfg = load_config(args.config, args.overrides)
    out = Path(args.out_dir) if args.out_dir else Path("runs") / f"analyze-{Path(args.config or 'default').stem}"
    launch(analyze_job, (cfg, str(out), args.seeds, args.rollouts, args.pre_updates), cfg, nproc=args.nproc)
    print(f"wrote {out / 'analysis.json'} and {out / 'analysis.png'}")
    return 0


def cmd_compare(args) -> int:
    """Compare runs: final / best eval reward, steps to a target, mismatch, masked fraction, collapse; PNG plots."""
    from megatron_pdm.compare import compare, format_table

    rows = compare(args.run_dirs, out_dir=args.out_dir, target=args.target)
    print(format_table(rows, args.target))
    print(f"wrote {args.out_dir}/compare.json and {args.out_dir}/compare.png")
    return 0


def cmd_serve(args) -> int:
    """Serve an HF checkpoint with the embedded engine over SGLang's HTTP worker API (the subset we use)."""
    from megatron_pdm.rollout.server import serve

    serve(args.model_path, host=args.host, port=args.port, dtype=args.dtype)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-pdm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help=cmd_env.__doc__).set_defaults(func=cmd_env)
    p = sub.add_parser("train", help=cmd_train.__doc__)
    p.add_argument("--config", help="YAML config (sections: model, parallel, objective, data, rollout, optim, train)")
    p.add_argument("--run-dir", help="where metrics, checkpoints and plots go (default runs/<config name>)")
    p.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint in --run-dir")
    p.add_argument("--nproc", type=int, help="local processes to spawn (default TP x PP x EP)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. objective.mask=dppo")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("analyze", help=cmd_analyze.__doc__)
    p.add_argument("--config", help="YAML config, as for train")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--rollouts", type=int, default=256, help="responses per seed")
    p.add_argument("--pre-updates", type=int, default=1,
                   help="optimizer steps on the rollouts before the measured one (the policy drifts from mu)")
    p.add_argument("--out-dir", help="where analysis.json and analysis.png go")
    p.add_argument("--nproc", type=int, help="local processes to spawn (default TP x PP x EP)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.set_defaults(func=cmd_analyze)
    p = sub.add_parser("compare", help=cmd_compare.__doc__)
    p.add_argument("run_dirs", nargs="+", help="run directories written by megatron-pdm train")
    p.add_argument("--target", type=float, default=0.5, help="eval reward whose first reach is reported")
    p.add_argument("--out-dir", default="compare", help="where compare.json and compare.png go")
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("serve", help=cmd_serve.__doc__)
    p.add_argument("--model-path", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=cmd_serve)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
