"""`megatron-pdm config-reference`."""

from __future__ import annotations

from megatron_pdm.commands import EPILOG


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("config-reference", help=run.__doc__, epilog=EPILOG)
    p.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is out of date")
    p.set_defaults(func=run)


def run(args) -> int:
    """Write the config reference docs/config.md from the config dataclasses (--check: say if it is out of date)."""
    from megatron_pdm.config_reference import main

    return main(["--check"] if args.check else [])
