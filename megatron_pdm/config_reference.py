"""The config reference, docs/config.md, generated from the config dataclasses (`train.config.Config`'s tree).

For every key: its dotted name, type, default, allowed values and one-line meaning. Each is read from the code
that defines it, so the page cannot drift from it (tests/test_config_reference.py fails when docs/config.md differs
from what this renders):
- type and default: the dataclass field (its annotation; `default` or `default_factory()`);
- allowed values: the constant tuple that the section's validation passes to `check_choice("<key>", self.<field>,
  CONSTANT)` (read from the section module's source, the constant from its namespace);
- meaning: the comment on the field's line, else the comment block right above it, else the line of the section's
  docstring that starts with the field's name (the sections document their fields as `name  text` tables or
  `name: text` sentences); a field documented nowhere says so.
A field whose default is itself a dataclass is a sub-section: its keys are listed with the longer prefix.

    python -m megatron_pdm.config_reference            # rewrite docs/config.md
    python -m megatron_pdm.config_reference --check    # exit 1 (and say so) if docs/config.md is out of date
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
import tokenize
from io import StringIO
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config.md"
REGENERATE = "python -m megatron_pdm.config_reference"


def _comments(cls) -> dict[str, str]:
    """field -> the comment on its line, or the comment block right above it (joined), from the class's source."""
    lines = inspect.getsource(cls).splitlines()
    found, block = {}, []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        m = re.match(r"\s+(\w+)\s*:[^=]*(=.*)?$", line)
        if m and not stripped.startswith(("def ", "class ", "return")):
            trailing = _trailing_comment(line)
            text = trailing or " ".join(block)
            if text:
                found.setdefault(m.group(1), text)
        block = []
    return found


def _trailing_comment(line: str) -> str:
    try:
        for tok in tokenize.generate_tokens(StringIO(line.strip() + "\n").readline):
            if tok.type == tokenize.COMMENT:
                return tok.string.lstrip("#").strip()
    except (tokenize.TokenError, IndentationError):
        pass
    return ""


def _docstring_lines(cls) -> dict[str, str]:
    """field -> its entry in the class docstring: a line starting with the field's name (`name  text`,
    `name: text`, `name text`), with its indented continuation lines."""
    doc = inspect.getdoc(cls) or ""
    names = {f.name for f in dataclasses.fields(cls)}
    found, current = {}, None
    for line in doc.splitlines():
        m = re.match(r"(\w+)(/\w+)?(:|\s{2,}|\s)(.*)$", line)
        if m and m.group(1) in names and m.group(1) not in found:
            current = m.group(1)
            found[current] = m.group(4).strip()
            for other in (m.group(2) or "").strip("/").split("/"):  # `eps_low/high`: documents eps_high too
                if other and f"{current.rsplit('_', 1)[0]}_{other}" in names:
                    found.setdefault(f"{current.rsplit('_', 1)[0]}_{other}", found[current])
        elif current and line.startswith(" ") and line.strip():
            found[current] += " " + line.strip()
        else:
            current = None
    return found


def _choices(cls) -> dict[str, tuple]:
    """field -> the allowed values its validation checks (`check_choice(name, self.field, CONSTANT)`)."""
    module = sys.modules[cls.__module__]
    tree = ast.parse(inspect.getsource(module))
    found = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check_choice"
                and len(node.args) >= 3):
            continue
        value, options = node.args[1], node.args[2]
        if (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "self"
                and isinstance(options, ast.Name) and isinstance(getattr(module, options.id, None), tuple | dict)):
            found.setdefault(value.attr, tuple(getattr(module, options.id)))
    return found


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _value(v) -> str:
    if v is dataclasses.MISSING:
        return "(required)"
    if isinstance(v, str):
        return f"`{v!r}`"
    return f"`{v}`" if v is not None and v != () and v != {} else f"`{v!r}`" if v is not None else "`None`"


def keys(cls, prefix: str) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, allowed values, meaning) of every key of section `cls` under `prefix`, sub-sections
    expanded in place."""
    comments, doc, choices = _comments(cls), _docstring_lines(cls), _choices(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = _default(f)
        if dataclasses.is_dataclass(default) and not isinstance(default, type):
            rows += keys(type(default), f"{prefix}{f.name}.")
            continue
        meaning = comments.get(f.name) or doc.get(f.name) or "(undocumented: see the section's docstring)"
        allowed = ", ".join(f"`{c}`" for c in choices.get(f.name, ()))
        rows.append((prefix + f.name, str(f.type), _value(default), allowed, meaning))
    return rows


def render() -> str:
    from megatron_pdm.train.config import Config

    out = ["# Config reference", "",
           f"Generated by `{REGENERATE}` from the config dataclasses; do not edit by hand (a test fails when this "
           "page is out of date). A run's YAML has one mapping per section; `megatron-pdm train KEY=VALUE` overrides "
           "any key. Allowed values are the ones the section checks at load; meanings come from the code's comments "
           "and docstrings.", ""]
    for section in dataclasses.fields(Config):
        cls = type(_default(section))
        doc = inspect.getdoc(cls) or ""
        summary = "" if doc.startswith(cls.__name__ + "(") else doc.split("\n\n")[0].replace("\n", " ")  # not the
        # dataclass's generated signature
        out += [f"## `{section.name}` ({cls.__module__}.{cls.__name__})", "", _cell(summary), "",
                "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        out += [f"| `{k}` | `{_cell(t)}` | {_cell(d)} | {_cell(a)} | {_cell(m)} |"
                for k, t, d, a, m in keys(cls, section.name + ".")]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="config_reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is out of date")
    parser.add_argument("--out", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is out of date: regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
