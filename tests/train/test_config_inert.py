"""Settings that act only under another setting's value (train/config.py `INERT`): one the user set (in the YAML or
an override) where it does nothing is refused or warned about, naming it, its value and the setting that makes it
inert; a default, a value equal to the unset one, and the resolved configs runs write pass silently."""

import json
import logging
from pathlib import Path

import pytest

from megatron_pdm.train.config import config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]
LOGGER = "megatron_pdm.train.config"
URLS = ["rollout.engine=sglang", "rollout.sglang.urls=[http://a:1]"]  # engines attached to, not launched
DATASET = ["data.train_path=x.jsonl", "model.tokenizer=tok"]  # (loading the config reads neither)

# (override, the other overrides that make it inert): warned about whatever the user set
WARNED = [
    ("rollout.lag=2", []),
    ("rollout.max_staleness=3", []),
    ("rollout.partial=false", []),
    ("rollout.segment_tokens=1", []),
    ("rollout.segment_tokens=1", ["rollout.schedule=streaming", "rollout.partial=false"]),
    ("rollout.overlap=false", []),
    ("rollout.overlap=false", ["rollout.schedule=lagged", "rollout.lag=0"]),
    ("objective.max_token_age=1", []),
    ("rollout.sglang.server=megatron-pdm", URLS),
    ("rollout.sglang.server_args=[--x]", URLS),
    ("rollout.sglang.engine_python=/venv/bin/python", URLS),
    ("data.max_operand=5", DATASET),
    ("data.train_path=x.jsonl", ["data.task=arithmetic"]),
    ("data.reward_concurrency=2", []),
    ("data.reward_retries=1", []),
    ("data.reward_timeout_s=5", []),
    ("data.warm_start_key=demo", [*DATASET, "train.warm_start_steps=0"]),
    ("train.warm_start_lr=0.01", ["train.warm_start_steps=0"]),
    ("objective.eps_low=0.1", []),
    ("objective.eps_high=0.3", []),
    ("objective.advantage_std_eps=0.001", ["objective.advantage=rloo"]),
    ("precision.fp8_recipe=tensorwise", []),
    ("precision.loss_scale=128", []),
    ("logging.wandb_project=p", []),
    ("logging.wandb_name=n", []),
    ("logging.wandb_group=g", []),
    ("logging.wandb_mode=offline", []),
    ("distill.beta=0.3", ["distill.teacher=x"]),
    ("distill.reward_coef=2", ["distill.teacher=x"]),
]

# (override, the setting that gives it effect, at the value that keeps it inert): refused when that setting is not
# given (the user set the key and not its feature), a warning when it is (a shared config under an override)
REFUSED = [
    *[(o, "distill.teacher=null") for o in ("distill.teacher_offload=true", "distill.kind=forward", "distill.beta=0.3",
                                           "distill.coef=0.5", "distill.as_reward=true", "distill.reward_coef=2")],
    ("rollout.overlong_buffer=1", "rollout.overlong=keep"),
    ("rollout.overlong_penalty_factor=0.5", "rollout.overlong=mask"),
    ("rollout.sglang.server=megatron-pdm", "rollout.engine=embedded"),
    ("rollout.sglang.server_args=[--x]", "rollout.engine=embedded"),
    ("rollout.sglang.engine_tp=2", "rollout.engine=embedded"),
    ("rollout.sglang.engine_python=/venv/bin/python", "rollout.engine=embedded"),
    ("rollout.sglang.weight_sync=tensor", "rollout.engine=embedded"),
    ("rollout.sglang.timeout_s=5", "rollout.engine=embedded"),
    ("rollout.sglang.tokens_per_s=10", "rollout.engine=embedded"),
    ("rollout.sglang.update_timeout_s=60", "rollout.engine=embedded"),
    ("rollout.sglang.retries=0", "rollout.engine=embedded"),
    ("rollout.sglang.max_restarts=0", "rollout.engine=embedded"),
    ("precision.kv_cache=fp8_e4m3", "rollout.engine=embedded"),
    ("cluster.engine_image=img", "rollout.engine=embedded"),
    ("rollout.sglang.weight_dir=/w", "rollout.sglang.weight_sync=disk"),
    ("data.prompt_key=q", "data.task=arithmetic"),
    ("data.answer_key=a", "data.eval_paths={}"),
    ("data.chat_template_kwargs={enable_thinking: false}", "data.chat_template=false"),
    ("train.init_path=/ckpt", "train.init=random"),
    ("train.max_rollout_rounds=2", "train.refill=false"),
    ("objective.kl_type=k3", "objective.kl_coef=0"),
    ("objective.kl_unbiased=true", "objective.kl_coef=0.0"),
    ("objective.correction_cap=3.0", "objective.correction=none"),
    ("objective.icepop_low=0.4", "objective.correction=tis"),
    ("objective.icepop_high=4.0", "objective.correction=none"),
    ("objective.rejection_threshold=0.5", "objective.rejection=none"),
    ("model.moe_ffn_hidden_size=16", "model.num_experts=0"),
    ("model.moe_router_topk=1", "model.model_type=qwen3"),
    ("model.moe_aux_loss_coeff=0.01", "model.num_experts=0"),
    ("model.moe_norm_topk_prob=false", "model.num_experts=0"),
    ("model.moe_token_dispatcher_type=allgather", "model.num_experts=0"),
    ("model.moe_enable_deepep=true", "model.model_type=qwen3"),
    ("model.moe_grouped_gemm=true", "model.num_experts=0"),
    ("model.rope_scaling_factor=2.0", "model.rope_scaling=none"),
    ("model.rope_original_max_position_embeddings=16", "model.rope_scaling=none"),
    ("model.rope_low_freq_factor=2.0", "model.rope_scaling=none"),
    ("model.rope_high_freq_factor=8.0", "model.rope_scaling=none"),
    ("model.rope_beta_fast=16.0", "model.rope_scaling=none"),
    ("model.rope_beta_slow=2.0", "model.rope_scaling=none"),
    ("model.rope_mscale=2.0", "model.rope_scaling=none"),
    ("model.rope_mscale_all_dim=1.0", "model.rope_scaling=none"),
    ("cluster.container_mounts=/d:/d", "cluster.container_image=null"),
]


def _inert_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "does nothing with" in r.getMessage()]


def test_every_inert_key_has_a_case():
    """A row added to INERT is added here too (with a value its key takes and what makes it inert)."""
    from megatron_pdm.train.config import INERT

    tested = {o.split("=")[0] for o, _ in WARNED} | {o.split("=")[0] for o, _ in REFUSED}
    assert tested == {key for row in INERT for key in row.keys}


@pytest.mark.parametrize("override, context", WARNED, ids=[o for o, _ in WARNED])
def test_an_inert_key_is_warned_about_naming_it_its_value_and_what_makes_it_inert(override, context, caplog):
    key = override.split("=")[0]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        load_config(None, [*context, override])
    warned = _inert_warnings(caplog)
    assert len(warned) == 1 and warned[0].startswith(f"{key}: ") and "\n" not in warned[0], warned


@pytest.mark.parametrize("override, gate", REFUSED, ids=[o for o, _ in REFUSED])
def test_an_inert_key_whose_feature_the_user_left_off_is_refused_and_warned_about_under_an_explicit_off(
        override, gate, caplog):
    """Refused when the user set the key and not the setting that gives it effect (a missing line); only a warning
    when the config sets that setting to the value that keeps the key inert (a shared config's key under an
    override that turns its feature off)."""
    key = override.split("=")[0]
    with pytest.raises(ValueError) as e:
        load_config(None, [override])
    message = str(e.value)
    assert message.startswith(f"{key}: ") and " does nothing with " in message and "; remove it, or set " in message \
        and "\n" not in message, message
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        load_config(None, [gate, override])
    warned = _inert_warnings(caplog)
    assert len(warned) == 1 and warned[0].startswith(f"{key}: "), warned


def test_the_message_names_the_key_its_value_and_the_setting():
    with pytest.raises(ValueError, match=r"^objective\.kl_unbiased: True does nothing with objective\.kl_coef 0\.0: "
                                         r"a setting of the KL penalty .*; remove it, or set objective\.kl_coef$"):
        load_config(None, ["objective.kl_unbiased=true"])
    with pytest.raises(ValueError, match=r"^rollout\.sglang\.timeout_s: 5\.0 does nothing with "
                                         r"rollout\.engine 'embedded': "):
        load_config(None, ["rollout.sglang.timeout_s=5.0"])


def test_the_lag_outside_schedule_lagged_warns(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert load_config(None, ["rollout.lag=3"]).lag == 0
    assert _inert_warnings(caplog) == ["rollout.lag: 3 does nothing with rollout.schedule 'sync': the lag of schedule "
                                       "'lagged' (how many steps older than the trainer's its rollouts' weights are)"]


@pytest.mark.parametrize("overrides", [["rollout.lag=1"], ["rollout.segment_tokens=2"],  # max_new_tokens 4: half
                                       ["objective.kl_type=low_var_kl"], ["data.max_operand=9", *DATASET],
                                       ["rollout.lag=2", "rollout.schedule=lagged"]])
def test_a_default_or_a_key_that_acts_passes_silently(overrides, caplog):
    """A key given at the value it has unset changes nothing, so it is not reported (a resolved config holds every
    key at its value)."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        load_config(None, overrides)
    assert _inert_warnings(caplog) == []


def test_a_resolved_config_reloads_with_its_warnings_and_without_a_refusal(caplog):
    """A run's config.yaml (and `submit`'s, which the job loads with the grid point's overrides) holds every key:
    it reloads silently where the user's config did, and with a key the user's config only warned about (its
    feature off explicitly) it warns again, never refuses."""
    silent = load_config(ROOT / "examples" / "tiny_cpu.yaml")
    warned = load_config(None, ["objective.kl_type=k3", "objective.kl_coef=0", "rollout.lag=2"])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert config_from_dict(json.loads(json.dumps(silent.to_dict()))) == silent
    assert _inert_warnings(caplog) == []
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert config_from_dict(json.loads(json.dumps(warned.to_dict()))) == warned
    assert [w.split(":")[0] for w in _inert_warnings(caplog)] == ["rollout.lag", "objective.kl_type"]


EXAMPLES = sorted(p for p in [*(ROOT / "examples").glob("*.yaml"), *(ROOT / "examples" / "presets").glob("*.yaml")]
                  # these read their model from the checkpoint their script builds; they set no inert key
                  if p.name not in ("qwen3_vocab_tiny.yaml", "tiny_deepseek_v3.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(ROOT / "examples").as_posix())
def test_the_shipped_examples_and_presets_set_no_inert_key(path, caplog, monkeypatch):
    monkeypatch.chdir(ROOT)  # the examples' relative paths
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cfg = load_config(path)
        config_from_dict(json.loads(json.dumps(cfg.to_dict())))  # as a run's resolved config.yaml reloads
    assert _inert_warnings(caplog) == []
