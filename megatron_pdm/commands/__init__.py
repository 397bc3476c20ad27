"""The `megatron-pdm` commands: one module per command, each with `add_parser(subparsers)` and `run(args) -> int`.
They import the library (train, cluster, rollout, models); the library never imports a command."""

from __future__ import annotations

import argparse
import os
import sys

EPILOG = ("Every config key (its type, default, allowed values and meaning; `megatron-pdm config-reference` "
          "regenerates it): docs/config.md")


def input_errors() -> tuple:
    """What bad input raises (a config, a data set, a checkpoint, a run directory; the message names it), in this
    process or in a spawned rank (`launch` raises a rank's as the same class): printed as one line
    `<command>: <message>`, exit code 2. Anything else is a bug and keeps its traceback."""
    import yaml

    from megatron_pdm.train.launch import USER_ERRORS

    return (*USER_ERRORS, yaml.YAMLError)


def refuse(command: str, error: BaseException) -> int:
    """Print `error` as one line `<command>: <message>` and return exit code 2 (its traceback with
    MEGATRON_PDM_TRACEBACKS=1: it is raised instead)."""
    from megatron_pdm.train.launch import TRACEBACKS

    if os.environ.get(TRACEBACKS) == "1":
        raise error
    print(f"{command}: {error}", file=sys.stderr)
    return 2


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse `argv`; overrides may come after options (`plan CONFIG --nodes 4 parallel.expert=8`): argparse leaves
    those over, and they join the command's overrides. Anything else left over is an argparse error (exit code 2)."""
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if not (hasattr(args, "overrides") and "=" in x and not x.startswith("-"))]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def add_writer_parser(subparsers, name: str, run, source: str, source_help: str) -> None:
    """A command that writes an HF checkpoint directory `--to` from one `source` (`--force`: replace it)."""
    p = subparsers.add_parser(name, help=run.__doc__, epilog=EPILOG)
    p.add_argument(source, help=source_help)
    p.add_argument("--to", required=True, help="the HF checkpoint directory to write")
    p.add_argument("--force", action="store_true", help="replace --to if it exists")
    p.set_defaults(func=run)
