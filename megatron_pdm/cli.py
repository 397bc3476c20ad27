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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-pdm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help=cmd_env.__doc__).set_defaults(func=cmd_env)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
