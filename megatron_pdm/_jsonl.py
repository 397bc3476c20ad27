"""Reading JSON-lines files with errors that name the file and the line; replacing a small text file whole."""

from __future__ import annotations

import json
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
    """Replace path's content whole, through a temporary file and a rename: a kill leaves the old file or the new."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
