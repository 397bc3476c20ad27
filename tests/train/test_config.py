"""Loading a config from YAML and `section.key=value` overrides: what YAML would silently misread (a comment, an
octal account, a date) or cannot parse is an error naming the override, the field and the value; an empty section
is an empty mapping."""

import math
import re
from dataclasses import fields
from pathlib import Path

import pytest

from megatron_pdm.train.config import SECTIONS, ClusterConfig, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny_cpu.yaml"


def test_an_override_yaml_cannot_parse_names_the_override_and_the_field():
    with pytest.raises(ValueError, match=re.escape("override 'data.arithmetic_prompt={a} plus {b} is': "
                                                   "data.arithmetic_prompt: '{a} plus {b} is' is not a YAML value")):
        load_config(TINY, ["data.arithmetic_prompt={a} plus {b} is"])
    quoted = load_config(TINY, ["data.arithmetic_prompt='{a} plus {b} is'"])
    assert quoted.data.arithmetic_prompt == "{a} plus {b} is"


@pytest.mark.parametrize("override, dropped", [("logging.wandb_name=exp #3", "'#3'"),
                                               ("logging.wandb_name=#3", "'#3'"),
                                               ("rollout.sglang.server_args=[--a] # b", "'# b'")])
def test_an_override_whose_comment_yaml_would_drop_is_refused(override, dropped):
    key = override.split("=", 1)[0]
    with pytest.raises(ValueError, match=re.escape(f"override {override!r}: {key}: YAML reads {dropped} as a comment "
                                                   "and drops it")):
        load_config(TINY, [override])


def test_a_hash_that_is_not_a_comment_passes():
    assert load_config(TINY, ["logging.wandb_name='exp #3'"]).logging.wandb_name == "exp #3"
    assert load_config(TINY, ['logging.wandb_name="exp #3"']).logging.wandb_name == "exp #3"
    assert load_config(TINY, ["logging.wandb_name=exp#3"]).logging.wandb_name == "exp#3"
    assert load_config(TINY, ["rollout.engine=sglang", "rollout.sglang.server_args=['--a #b']"]) \
        .rollout.sglang.server_args == ("--a #b",)


def test_a_string_field_yaml_read_as_a_number_is_refused(tmp_path):
    """YAML 1.1 reads an unquoted 0123 as the octal 83 (`#SBATCH --account=83`): refused in an override (naming its
    text), and a number in any other string field in a file too; an account or partition number is its decimal
    text; quoted, the text is the value."""
    with pytest.raises(ValueError, match=re.escape("override 'cluster.account=0123': cluster.account: 83: quote it "
                                                   "(the field is a string, and YAML reads '0123' as the int 83")):
        load_config(TINY, ["cluster.account=0123"])
    (tmp_path / "c.yaml").write_text("cluster:\n  account: 1234\n  partition: 7\n")  # a name as it stands
    assert (load_config(tmp_path / "c.yaml").cluster.account, load_config(tmp_path / "c.yaml").cluster.partition) \
        == ("1234", "7")  # (in a file YAML has lost how it was written: an unquoted 0123 is 83 there)
    (tmp_path / "c.yaml").write_text("logging:\n  wandb_group: 2024\n")
    with pytest.raises(ValueError, match=r"logging.wandb_group: 2024: quote it \(a string field"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text("cluster:\n  account: '0123'\n  partition: '7'\n")
    c = load_config(tmp_path / "c.yaml").cluster
    assert (c.account, c.partition) == ("0123", "7")
    for override, shown in (("logging.wandb_group=2024", "2024"), ("logging.wandb_name=yes", "True"),
                            ("data.system_prompt=1.5", "1.5")):
        with pytest.raises(ValueError, match=re.escape(f"{override.split('=')[0]}: {shown}: quote it")):
            load_config(TINY, [override])


def test_an_unquoted_date_names_its_field(tmp_path):
    """A date (YAML's reading of 2024-05-01) is an error naming the field and the value, not a TypeError."""
    (tmp_path / "c.yaml").write_text("logging:\n  wandb_name: 2024-05-01\n")
    with pytest.raises(ValueError, match=re.escape("logging.wandb_name: 2024-05-01: quote it")):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text("cluster:\n  env: {DAY: 2024-05-01}\n")
    with pytest.raises(ValueError, match=re.escape("cluster.env.DAY: 2024-05-01: quote it")):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(ValueError, match=re.escape("override 'logging.wandb_name=2024-05-01': logging.wandb_name: "
                                                   "2024-05-01: quote it")):
        load_config(None, ["logging.wandb_name=2024-05-01"])
    assert load_config(None, ["logging.wandb_name='2024-05-01'"]).logging.wandb_name == "2024-05-01"


def test_an_empty_section_is_an_empty_mapping(tmp_path):
    (tmp_path / "c.yaml").write_text("cluster:\n  # nodes: 2\nlogging:\n")
    assert load_config(tmp_path / "c.yaml").cluster == ClusterConfig()
    assert load_config(tmp_path / "c.yaml", ["cluster.nodes=2"]).cluster.nodes == 2
    (tmp_path / "c.yaml").write_text("cluster: [1]\n")
    with pytest.raises(ValueError, match=re.escape("override 'cluster.nodes=2': cluster: expected a mapping, got "
                                                   "list")):
        load_config(tmp_path / "c.yaml", ["cluster.nodes=2"])


def test_valid_values_load_as_before(tmp_path):
    """What loaded before loads to the same values: numbers for numeric fields, strings, a file's mappings with
    JSON's keys."""
    (tmp_path / "c.yaml").write_text("data:\n  chat_template: true\n  chat_template_kwargs: {1: x, enable_thinking: "
                                     "false}\n")
    cfg = load_config(tmp_path / "c.yaml", ["train.steps=7", "optim.lr=3e-4", "cluster.time='04:00:00'",
                                            "cluster.account=acct", "logging.wandb_name=null"])
    assert (cfg.train.steps, cfg.optim.lr, cfg.cluster.time, cfg.cluster.account) == (7, 3e-4, "04:00:00", "acct")
    assert cfg.data.chat_template_kwargs == {"1": "x", "enable_thinking": False} and cfg.logging.wandb_name is None


def test_a_stop_warning_of_half_the_time_limit_is_refused():
    with pytest.raises(ValueError, match=re.escape("cluster.stop_warning_s: 900 s (--signal) must be less than half "
                                                   "of cluster.time '00:30:00' (1800 s)")):
        load_config(None, ["cluster.time='00:30:00'", "cluster.stop_warning_s=900"])
    assert load_config(None, ["cluster.time='00:30:00'", "cluster.stop_warning_s=899"]).cluster.stop_warning_s == 899


def test_cli_refuses_a_long_signal_and_a_missing_run_dir_in_one_line(tmp_path, capsys, monkeypatch):
    """`submit --time 00:30:00 --signal 3600` and `compare nosuchdir`: one line and exit 2, no traceback."""
    from megatron_pdm.cli import main
    from tests.helpers import one_line

    monkeypatch.chdir(tmp_path)
    preset = str(ROOT / "examples" / "presets" / "qwen3_4b.yaml")
    assert main(["submit", preset, "--dry-run", "--time", "00:30:00", "--signal", "3600"]) == 2
    assert "cluster.stop_warning_s: 3600 s (--signal) must be less than half of cluster.time '00:30:00'" in one_line(
        capsys, "submit")
    assert main(["compare", "nosuchdir", "--out-dir", str(tmp_path / "out")]) == 2
    assert "compare: nosuchdir: no metrics.jsonl" in one_line(capsys, "compare")


# (section, field, type) of every number of every config section: the sweep below reaches a field added later too
NUMERIC = [(section, f.name, str(f.type)) for section, make in SECTIONS.items() for f in fields(type(make()))
           if re.search(r"\b(int|float)\b", str(f.type))]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 10**400], ids=["inf", "-inf", "nan", "10^400"])
def test_every_numeric_field_refuses_a_non_finite_value_at_load_naming_it(value):
    """YAML's .inf / -.inf / .nan (and an integer beyond the float range, which float arithmetic makes inf) in any
    numeric field of any section is a one-line ValueError naming that field, at load: infinities passed the range
    checks (inf > 0) and failed later in another process, naming nothing (optim.lr, rollout.temperature,
    train.eval_temperature: .inf started a run). An integer field takes any size of integer (check_int), so the
    10^400 case walks the float fields only."""
    assert len(NUMERIC) > 80 and {s for s, _, _ in NUMERIC} >= set(SECTIONS) - {"logging"}  # the walk is complete
    for section, name, kind in NUMERIC:
        if value == 10**400 and "float" not in kind:
            continue
        with pytest.raises(ValueError) as e:
            config_from_dict({section: {name: value}})
        message = str(e.value)
        assert message.startswith(f"{section}.{name}: ") and "\n" not in message, (section, name, message)


@pytest.mark.parametrize("override", ["optim.lr=.inf", "rollout.temperature=.inf", "train.eval_temperature=.inf",
                                      "rollout.temperature=.nan", "objective.ratio_cap=-.inf",
                                      "precision.loss_scale=.inf"])
def test_an_infinite_override_is_refused_naming_its_field(override):
    key, text = override.split("=")
    with pytest.raises(ValueError, match=rf"^{re.escape(key)}: expected a finite number, got -?(inf|nan)$"):
        load_config(TINY, [override])
