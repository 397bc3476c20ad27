"""Reading JSON-lines files with errors that name the file and the line; replacing a small text file whole."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_jsonl(path) -> list[tuple[int, object]]:
    """(line number, record) for every non-blank line; ValueError `path:line: not UTF-8 (...)` or
    `path:line: not valid JSON (...)` otherwise."""
    path = Path(path)
    out = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                out.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    return out


def write_atomic(path, text: str) -> None:
    """Replace path's content whole, through a temporary file beside it, on disk (fsync) before the rename: a kill, a
    full disk or a machine's crash leaves the old file or the new, never a part (the cost: one fsync a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
