"""`megatron-pdm plan` (the memory model: cluster/plan.py)."""

from __future__ import annotations

import json
import sys

from megatron_pdm.commands import EPILOG


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help=run.__doc__, epilog=EPILOG)
    p.add_argument("config", help="YAML config (model, parallel, train, rollout, precision, cluster sections)")
    p.add_argument("--nodes", type=int, help="nodes in all (default cluster.nodes)")
    p.add_argument("--gpu", choices=["h100", "h200", "b200"], help="GPU kind (default cluster.gpu)")
    p.add_argument("--host-mem", type=float, metavar="GB",
                   help="host memory per node, GiB (default: the GPU kind's standard node: 2048 for H100 / H200, "
                        "4096 for B200)")
    p.add_argument("--top", type=int, default=10, help="how many fitting layouts to list")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.set_defaults(func=run)


def run(args) -> int:
    """Parameter counts, per-GPU and host memory and the ranked TP / PP / EP / CP / DP layouts that fit, before
    launch."""
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
