"""The config reference, docs/config.md, generated from the dataclass tree under train/config.py's `Config`.

Every key (its dotted path), its type, its default, its allowed values where the validation declares a fixed set
(a module constant passed to `check_choice` or tested with `not in`), and a one-line meaning: the field's trailing
comment, else the comment block right above it, else the sentence of its class docstring that names it. Nested
dataclass sections (a field whose default is a dataclass) are walked generically.

    python -m megatron_pdm.config_reference            rewrite docs/config.md
    python -m megatron_pdm.config_reference --check    exit 1 when docs/config.md is out of date
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
from pathlib import Path

from megatron_pdm.train.config import Config

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"
COMMAND = "python -m megatron_pdm.config_reference"
MEANING_CHARS = 200  # a table cell stays one readable line; the source comment has the rest

_CONST = r"([A-Z][A-Z0-9_]*)(?![\w\[])"  # a constant itself, not an item of it
_CHOICE_CALL = re.compile(r'check_choice\(\s*f?"(?:[\w.]*\.)?(\w+)",\s*[^,]+,\s*' + _CONST + r"\)")
_CHOICE_PAIR = re.compile(r'\(\s*"(\w+)",\s*' + _CONST + r"\s*\)")  # for name, allowed in (("train", TRAIN), ...)
_NOT_IN = re.compile(r"self\.(\w+) not in " + _CONST)


def _allowed(cls) -> dict[str, tuple]:
    """field name -> allowed values, read from the fixed sets that cls's own validation uses."""
    source, names = inspect.getsource(cls), vars(sys.modules[cls.__module__])
    found = _CHOICE_CALL.findall(source) + _NOT_IN.findall(source)
    if "check_choice(f" in source:
        found += _CHOICE_PAIR.findall(source)
    out = {}
    for name, const in found:
        values = names.get(const)
        if name not in out and isinstance(values, (tuple, list, frozenset, set, dict)):
            out[name] = tuple(values)
    return out


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MEANING_CHARS else text[:MEANING_CHARS - 3].rstrip() + "..."


def _comments(cls) -> dict[str, str]:
    """field name -> its trailing comment, or the comment block right above its line."""
    out, block = {}, []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("# "))
            continue
        m = re.match(r"\s+(\w+): [^=]+?(?:=.*?)?(?:\s+#\s*(.*))?$", line)
        if m and m.group(1) in {f.name for f in dataclasses.fields(cls)}:
            text = m.group(2) or " ".join(block)
            if text:
                out[m.group(1)] = _one_line(text)
        block = []
    return out


def _column_names(head: str) -> set[str]:
    """The fields a docstring column entry names: `eps_low/high` is eps_low and eps_high."""
    first, *rest = head.split("/")
    stem = first.rsplit("_", 1)[0] + "_" if "_" in first else ""
    return {first, *rest, *(stem + r for r in rest)}


def _from_docstring(doc: str, name: str) -> str:
    """The docstring's entry for name: a `name  text` column entry (with its indented continuation lines), else
    the sentence that names it."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*([\w/]+):?\s+(\S.*)$", line)
        if m and name in _column_names(m.group(1)):
            text, indent = [m.group(2)], len(line) - len(line.lstrip()) + 1
            for more in lines[i + 1:]:
                if more.strip() and len(more) - len(more.lstrip()) > indent:
                    text.append(more.strip())
                else:
                    break
            return _one_line(" ".join(text))
    flat = " ".join(doc.split())
    for sentence in re.split(r"(?<=[.;])\s+", flat):
        if re.search(r"(?<![\w.])`?" + re.escape(name) + r"`?(?![\w])", sentence):
            return _one_line(sentence)
    return ""


def _shown(value) -> str:
    if isinstance(value, tuple):
        value = list(value)
    if value is None:
        return "null"
    return json.dumps(value) if isinstance(value, (bool, list, dict, str)) else repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _rows(cls, prefix: str) -> list[tuple[str, list[list[str]]]]:
    """(section title, table rows) for cls and, after it, every nested dataclass section."""
    allowed, comments, doc = _allowed(cls), _comments(cls), inspect.getdoc(cls) or ""
    if doc == inspect.getdoc(object) or doc.startswith(cls.__name__ + "("):
        doc = ""  # dataclass's generated signature, not a docstring
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        value = _default(f)  # the declared default (objective.delta's None, not what __post_init__ makes of it)
        if dataclasses.is_dataclass(value):
            nested.extend(_rows(type(value), f"{prefix}{f.name}."))
            continue
        choices = ", ".join(f"`{v}`" for v in allowed.get(f.name, ()))
        meaning = comments.get(f.name) or _from_docstring(doc, f.name)
        rows.append([f"`{prefix}{f.name}`", _cell(str(f.type)), f"`{_cell(_shown(value))}`", choices, _cell(meaning)])
    return ([(prefix.rstrip("."), rows)] if rows else []) + nested


def render() -> str:
    """docs/config.md's text."""
    out = ["# Config reference", "",
           f"Generated from the config dataclasses by `{COMMAND}` (do not edit by hand; `--check` tells whether this",
           "file is current). Every key of a run's YAML, under its section; `section.key=value` after the command",
           "overrides one. The meaning is the field's comment in the source (one line; the docstring of its class has",
           "the rest).", ""]
    for title, rows in _rows(Config, ""):
        out += [f"## {title}", "", "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description="Write (or --check) docs/config.md, the config reference.")
    p.add_argument("--check", action="store_true", help="exit 1 when docs/config.md differs from the generated text")
    p.add_argument("--out", type=Path, default=DOC, help=f"the file (default {DOC})")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
