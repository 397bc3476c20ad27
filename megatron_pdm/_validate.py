"""Config validators shared by every config dataclass: each raises a ValueError that names the field (its dotted
name, e.g. `rollout.n`) and the offending value. Pure Python, at the bottom of the layering (imports nothing)."""

from __future__ import annotations

import dataclasses
import math


def is_int(value) -> bool:
    """An integer, and not a bool (YAML's `true` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An int or float that is not a bool and not NaN (infinities pass; `check_number(finite=True)` refuses them)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def check_int(field: str, value, lo: int | None = 1, *, special: int | None = None, special_note: str = "") -> int:
    """value, an integer >= lo (any integer when lo is None), or exactly `special` (e.g. -1 for "no limit", described
    by `special_note`). ValueError: "<field>: expected an integer >= <lo>, got <value!r>"."""
    if special is not None and is_int(value) and value == special:
        return value
    if not is_int(value) or (lo is not None and value < lo):
        what = "an integer" if lo is None else f"an integer >= {lo}"
        if special is not None:
            what = f"{special}{f' ({special_note})' if special_note else ''} or {what}"
        raise ValueError(f"{field}: expected {what}, got {value!r}")
    return value


def is_finite(value) -> bool:
    """A number that is neither infinite nor NaN: an int too large for a float (YAML's 1 followed by 400 digits)
    counts as infinite, as every float computation with it would make it."""
    try:
        return is_number(value) and math.isfinite(value)
    except OverflowError:
        return False


def check_number(field: str, value, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                 hi_open: bool = False, finite: bool = False) -> float:
    """value, a number (int or float, not a bool, not NaN; finite when `finite`) in the range [lo, hi], each end open
    when lo_open / hi_open. ValueError: "<field>: expected a number, got <value!r>" or "<field>: <value!r> must be
    > <lo>" (>=, <, <= alike)."""
    if not is_number(value) or (finite and not is_finite(value)):
        raise ValueError(f"{field}: expected a {'finite ' if finite else ''}number, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ValueError(f"{field}: {value!r} must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and (value > hi or (hi_open and value == hi)):
        raise ValueError(f"{field}: {value!r} must be {'<' if hi_open else '<='} {hi}")
    return value


def check_finite(section: str, config) -> None:
    """Every number in a float-typed field of the dataclass `config` (the config section `section`) is finite: YAML
    reads .inf and .nan as floats, which pass a range check (inf > 0) and fail late, in another process, naming no
    field. Called first in each section's __post_init__, before checks that compare fields with one another. No
    setting takes infinity for "no limit": each has a finite off value (0, none) or a finite bound that does the
    same. ValueError: "<section>.<field>: expected a finite number, got <value!r>"."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)  # NaN too (not is_number)
        if "float" in str(f.type) and numeric and not is_finite(value):
            raise ValueError(f"{section}.{f.name}: expected a finite number, got {value!r}")


def check_bool(field: str, value) -> bool:
    """value, true or false. ValueError: "<field>: expected true or false, got <value!r>"."""
    if not isinstance(value, bool):
        raise ValueError(f"{field}: expected true or false, got {value!r}")
    return value


def check_choice(field: str, value, options) -> str:
    """value, one of `options`. ValueError: "<field>: <value!r> is not one of a, b, c"."""
    if value not in options:
        raise ValueError(f"{field}: {value!r} is not one of {', '.join(map(str, options))}")
    return value


def check_one_line(field: str, value: str) -> str:
    """value, a string without a newline or another control character: `submit` writes it into a Slurm batch
    script, where a newline would end an #SBATCH comment and run the rest as a shell command, and sbatch's
    directive parser cannot carry one at all."""
    if not isinstance(value, str) or not value.isprintable():
        raise ValueError(f"{field}: {value!r} is not a one-line string (a newline or another control character "
                         "cannot go into a Slurm batch script)")
    return value
