"""docs/config.md is the config reference generated from the dataclasses (issue 55): it must be what the code says."""

import dataclasses

import pytest

from megatron_pdm import config_reference
from megatron_pdm.config_reference import PAGE, REGENERATE, keys, render


def test_the_config_reference_is_up_to_date():
    assert PAGE.exists(), f"{PAGE} is missing: generate it with `{REGENERATE}`"
    assert PAGE.read_text() == render(), f"{PAGE} is out of date: regenerate it with `{REGENERATE}`"


def test_every_key_is_listed_with_its_default_and_its_checked_choices():
    from megatron_pdm.objectives.config import MASKS
    from megatron_pdm.train.config import Config

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from walk(value, f"{prefix}{f.name}.")
            else:
                yield prefix + f.name, value

    rows = {k: (t, d, a, m) for section in dataclasses.fields(Config)
            for k, t, d, a, m in keys(type(getattr(Config(), section.name)), section.name + ".")}
    expected = dict(walk(Config(), ""))
    assert set(rows) == set(expected)
    assert rows["objective.mask"][1] == "`'pdm'`" and rows["objective.mask"][2] == ", ".join(f"`{m}`" for m in MASKS)
    assert rows["train.steps"][1] == f"`{expected['train.steps']}`"
    assert "RoPE scaling" in rows["model.rope_scaling"][3]  # a comment block above the field


def test_check_names_the_command_that_regenerates(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("# an old page\n")
    assert config_reference.main(["--check", "--out", str(stale)]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert config_reference.main(["--out", str(stale)]) == 0
    assert config_reference.main(["--check", "--out", str(stale)]) == 0


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["plan", "--help"]])
def test_the_help_points_to_the_config_reference(argv, capsys):
    from megatron_pdm.cli import main

    with pytest.raises(SystemExit):
        main(argv)
    assert "docs/config.md" in " ".join(capsys.readouterr().out.split())
