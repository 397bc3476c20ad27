"""`megatron-pdm compare` (the comparison itself: cluster/compare.py)."""

from __future__ import annotations

from megatron_pdm.commands import EPILOG, input_errors, refuse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("compare", help=run.__doc__, epilog=EPILOG)
    p.add_argument("run_dirs", nargs="+", help="run directories written by megatron-pdm train")
    p.add_argument("--target", type=float, default=0.5, help="eval reward whose first reach is reported")
    p.add_argument("--out-dir", default="compare", help="where compare.json and compare.png go")
    p.add_argument("--over-seeds", action="store_true",
                   help="one row (and one mean curve) per setting: runs that differ only in train.seed")
    p.set_defaults(func=run)


def run(args) -> int:
    """Compare runs: final / best eval reward, steps to a target, mismatch, masked fraction, collapse; PNG plots."""
    from megatron_pdm.cluster.compare import compare, format_table

    try:  # a missing run directory, a bad metrics line or config: one line, no traceback
        rows = compare(args.run_dirs, out_dir=args.out_dir, target=args.target, over_seeds=args.over_seeds)
    except input_errors() as e:
        return refuse("compare", e)
    print(format_table(rows, args.target))
    print(f"wrote {args.out_dir}/compare.json and {args.out_dir}/compare.png")
    return 0
