"""What a command's --force may delete: the one guard for every command that replaces a directory the user named
(`export --to`, `from-gguf --to`), and the deletion itself. Pure Python, at the bottom of the layering.

A target is refused when it is, or contains, anything the command still needs or the user stands in: its inputs
and its run directory (the caller names them), the current directory (so /), the home directory. Symlinks are
resolved for the check, so a link to any of those is refused too."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def _always_kept() -> list[tuple[str, Path]]:
    """The current directory (and so /, which holds it) and the home directory."""
    cwd, home = Path.cwd(), Path(os.path.expanduser("~"))  # home: "~" itself when no $HOME nor password entry
    return [(f"the current directory {cwd}", cwd), *([(f"the home directory {home}", home)] if home.is_absolute()
                                                     else [])]


def deletion_problem(label: str, target, keep) -> str | None:
    """Why deleting `target` would destroy something, as one line that starts with `label` (how the command names
    the target, e.g. "--to out"), or None: `target` is, or holds, one of `keep` ((description, path) pairs, e.g.
    ("the GGUF file x.gguf", path)), the current directory (so /) or the home directory."""
    resolved = Path(target).resolve()
    for description, path in [*keep, *_always_kept()]:
        path = Path(path).resolve()
        if resolved == path or resolved in path.parents:
            return (f"{label}: {'is' if resolved == path else 'contains'} {description}; replacing it would delete "
                    "that: choose another directory")
    return None


def remove(path) -> None:
    """Delete `path` (a directory tree, a file, or a symlink: the link, never what it points to), which a command
    replaces; `deletion_problem` said yes first."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
