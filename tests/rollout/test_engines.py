"""The engine registry (rollout/engines.py) and the mover of the previous release's flat engine keys
(train/config.py): `rollout.urls` reads as `rollout.sglang.urls`, with one warning naming both keys."""

import logging
from dataclasses import fields

import pytest
import yaml

from megatron_pdm.rollout.engines import ENGINES, engine_spec
from megatron_pdm.rollout.sglang.config import SGLangConfig
from megatron_pdm.train.config import load_config

LOGGER = "megatron_pdm.train.config"
# every SGLang key of the previous release, flat, at a value other than its default
OLD = {"urls": ["http://a:1", "http://b:2"], "server_args": ["--x"], "engine_python": "/venv/bin/python",
       "weight_sync": "distributed", "timeout_s": 7.0, "tokens_per_s": 9.0, "update_timeout_s": 60.0, "retries": 0,
       "max_restarts": 1, "router": True}


def _moved(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "moved to" in r.getMessage()]


def test_an_unknown_engine_is_a_one_line_error_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"^rollout\.engine: 'vllm' is not one of embedded, sglang$"):
        load_config(None, ["rollout.engine=vllm"])
    with pytest.raises(ValueError, match=r"^rollout\.engine: 'vllm' is not one of embedded, sglang$"):
        engine_spec("vllm")
    assert list(ENGINES) == ["embedded", "sglang"] and engine_spec("sglang").config is SGLangConfig


def test_each_spec_names_its_sub_section_and_moves_only_its_own_keys():
    """A spec's sub-section is the `RolloutConfig` field of its name, and the keys it moves are that sub-section's."""
    from megatron_pdm.rollout.config import RolloutConfig

    names = {f.name for f in fields(RolloutConfig)}
    for spec in ENGINES.values():
        if spec.config is None:
            assert not spec.moved
            continue
        assert spec.name in names and isinstance(getattr(RolloutConfig(), spec.name), spec.config)
        assert set(spec.moved) <= {f.name for f in fields(spec.config)} and not set(spec.moved) & names


@pytest.mark.parametrize("where", ["yaml", "override"])
def test_old_flat_keys_load_as_the_new_ones_with_one_warning_each(where, tmp_path, caplog):
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({"rollout": {"engine": "sglang", "n": 2, "sglang": OLD}}))
    expected = load_config(new)
    old = tmp_path / "old.yaml"
    if where == "yaml":
        old.write_text(yaml.safe_dump({"rollout": {"engine": "sglang", "n": 2, **OLD}}))
        overrides = []
    else:
        old.write_text(yaml.safe_dump({"rollout": {"engine": "sglang", "n": 2}}))
        overrides = [f"rollout.{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in OLD.items()]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert load_config(old, overrides) == expected
    warned = _moved(caplog)
    assert len(warned) == len(OLD), warned  # once per key, though the loader moves keys at two places
    for key in OLD:
        assert sum(w.startswith(f"rollout.{key}: moved to rollout.sglang.{key} ") for w in warned) == 1, (key, warned)
        assert any(w.endswith(f"set rollout.sglang.{key} instead") for w in warned)
    assert expected.rollout.sglang.urls == ("http://a:1", "http://b:2") and expected.rollout.sglang.retries == 0


def test_an_old_key_beside_its_new_one_must_agree(tmp_path, caplog):
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump({"rollout": {"engine": "sglang", "urls": ["http://a:1"],
                                                "sglang": {"urls": ["http://b:2"]}}}))
    with pytest.raises(ValueError, match=r"^rollout\.urls: \['http://a:1'\] differs from rollout\.sglang\.urls "
                                         r"\['http://b:2'\]; .*: remove rollout\.urls$"):
        load_config(path)
    path.write_text(yaml.safe_dump({"rollout": {"engine": "sglang", "urls": ["http://a:1"],
                                                "sglang": {"urls": ["http://a:1"]}}}))
    assert load_config(path).rollout.sglang.urls == ("http://a:1",)
    # an override of the old key replaces the file's new one: the override is moved before it applies
    assert load_config(path, ["rollout.urls=[http://c:3]"]).rollout.sglang.urls == ("http://c:3",)


def test_a_sub_section_key_is_checked_like_a_section_key():
    """Overrides reach into a sub-section; an unknown key or a string YAML reads as a number names its full key."""
    with pytest.raises(ValueError, match=r"^rollout\.sglang: unknown key\(s\) nope; known: "):
        load_config(None, ["rollout.engine=sglang", "rollout.sglang.nope=1"])
    with pytest.raises(ValueError, match=r"rollout\.sglang\.engine_python: 3: quote it"):
        load_config(None, ["rollout.engine=sglang", "rollout.sglang.engine_python=3"])
    with pytest.raises(ValueError, match=r"rollout\.n\.x: no such sub-section in rollout"):
        load_config(None, ["rollout.n.x=1"])
