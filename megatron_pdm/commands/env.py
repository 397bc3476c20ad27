"""`megatron-pdm env`."""

from __future__ import annotations

import platform
from importlib import metadata

from megatron_pdm.commands import EPILOG


def add_parser(subparsers) -> None:
    subparsers.add_parser("env", help=run.__doc__, epilog=EPILOG).set_defaults(func=run)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def run(args) -> int:
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
