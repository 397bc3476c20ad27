"""User code a config names (`data.reward`, `rollout.tool_fn`, `rollout.generate_fn`): `package.module:function` or
`path/to/file.py:function`, imported at load so that a module that does not import fails before any compute."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path


def load_function(spec: str, field: str) -> Callable:
    """The user function `package.module:function` or `path/to/file.py:function` that config field `field` names.
    Modules are looked up on sys.path and then in the current directory."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{field}: expected 'package.module:function' or 'file.py:function', got {spec!r}")
    module_name, fn_name = spec.split(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise FileNotFoundError(f"no such file {str(path)!r}")
            module_spec = importlib.util.spec_from_file_location(f"megatron_pdm_user_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module  # as an import would (dataclasses look their module up there)
            module_spec.loader.exec_module(module)
        else:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError:
                if "" in sys.path or str(Path.cwd()) in sys.path:
                    raise
                sys.path.append(str(Path.cwd()))  # `megatron-pdm` runs from a console script: its sys.path lacks cwd
                module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - a broken user module: say which and why
        raise ValueError(f"{field}: cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{field}: {module_name!r} has no function {fn_name!r}")
    return fn
