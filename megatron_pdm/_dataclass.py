"""Loading typed config dataclasses from plain dicts (YAML), rejecting unknown keys by name."""

from __future__ import annotations

from dataclasses import fields


def from_dict(cls, values, section: str):
    """cls(**values), or a ValueError naming the section and the unknown key(s) or the bad value."""
    if not isinstance(values, dict):
        raise ValueError(f"{section}: expected a mapping, got {type(values).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{section}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return cls(**values)
    except TypeError as e:
        raise ValueError(f"{section}: {e}") from None
