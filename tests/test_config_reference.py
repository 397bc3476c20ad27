"""docs/config.md, the config reference, is generated from the config dataclasses and must match them."""

import dataclasses

from megatron_pdm import config_reference
from megatron_pdm.objectives.config import MASKS
from megatron_pdm.train.config import Config


def _keys(cls, prefix=""):
    for f in dataclasses.fields(cls):
        value = config_reference._default(f)
        if dataclasses.is_dataclass(value):
            yield from _keys(type(value), f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_config_md_is_current():
    text = config_reference.render()
    assert config_reference.DOC.read_text() == text, \
        f"docs/config.md is out of date with the config dataclasses: run `{config_reference.COMMAND}`"


def test_every_key_once_with_its_choices_and_meaning():
    rows = [line for line in config_reference.render().splitlines() if line.startswith("| `")]
    keys = [line.split("`")[1] for line in rows]
    assert keys == list(_keys(Config))
    mask = rows[keys.index("objective.mask")]
    assert ", ".join(f"`{m}`" for m in MASKS) in mask and "clip-higher on r" in mask  # docstring column entry
    eps_high = rows[keys.index("objective.eps_high")]
    assert "PPO clip range" in eps_high  # `eps_low/high` in the docstring names both


@dataclasses.dataclass(frozen=True)
class _Engine:
    """port  the server's port"""

    port: int = 30000
    mode: str = "a"  # how it runs


@dataclasses.dataclass(frozen=True)
class _Rollout:
    n: int = 4  # samples per prompt
    sglang: _Engine = dataclasses.field(default_factory=_Engine)


def test_nested_sections_walk_generically():
    sections = config_reference._rows(_Rollout, "rollout.")
    assert [title for title, _ in sections] == ["rollout", "rollout.sglang"]
    port, mode = sections[1][1]
    assert port[0] == "`rollout.sglang.port`" and port[4] == "the server's port"
    assert mode[0] == "`rollout.sglang.mode`" and mode[2] == '`"a"`' and mode[4] == "how it runs"


def test_check_fails_on_a_stale_file(tmp_path, capsys):
    out = tmp_path / "config.md"
    assert config_reference.main(["--out", str(out), "--check"]) == 1
    assert config_reference.COMMAND in capsys.readouterr().err
    assert config_reference.main(["--out", str(out)]) == 0
    assert config_reference.main(["--out", str(out), "--check"]) == 0

