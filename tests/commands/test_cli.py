"""The command table: every command is listed, and `megatron-pdm --help` and each command's --help end with the line
that points to the config reference."""

import pytest

from megatron_pdm.cli import main

COMMANDS = ["env", "train", "export", "from-gguf", "analyze", "compare", "sweep", "plan", "submit", "serve",
            "config-reference"]


@pytest.mark.parametrize("argv", [["--help"], *[[c, "--help"] for c in COMMANDS]])
def test_every_help_ends_pointing_to_the_config_reference(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert out.rstrip().splitlines()[-1].endswith("docs/config.md"), out
    if argv == ["--help"]:
        assert all(c in out for c in COMMANDS), out


def test_an_unknown_command_and_a_stray_flag_are_argparse_errors(capsys):
    for argv in (["nope"], ["plan", "examples/tiny_cpu.yaml", "--nope"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2, argv
    assert "unrecognized arguments: --nope" in capsys.readouterr().err
