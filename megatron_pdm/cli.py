"""`megatron-pdm` command line."""

from __future__ import annotations

import argparse
import sys

from megatron_pdm.commands import (
    EPILOG,
    analyze,
    compare,
    config_reference,
    env,
    export,
    from_gguf,
    parse,
    plan,
    serve,
    submit,
    sweep,
    train,
)

# the order `megatron-pdm --help` lists them in
COMMANDS = (env, train, export, from_gguf, analyze, compare, sweep, plan, submit, serve, config_reference)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-pdm", description=__doc__, epilog=EPILOG)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(subparsers)
    args = parse(parser, argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
