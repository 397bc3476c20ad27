"""The RL trainer: parallel training steps equal the TP = 1 step, resume equality, the CLI, config errors."""

import json
import logging
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatron_pdm.models import ModelConfig, canonical_hf_state, save_hf_checkpoint
from megatron_pdm.train.config import config_from_dict, load_config
from megatron_pdm.train.data import ARITHMETIC_TOKENIZER
from tests.helpers import (
    ROOT,
    TRAIN_DENSE,
    TRAIN_MOE,
    compare_rows,
    hf_model,
    init_checkpoint,
    one_line,
    published_checkpoint,
    rank_train,
    train_cfg,
)

# DeepSeek-V3's layout: MLA with q / kv LoRA, a dense first layer, 8 experts top-4 in 2 of 4 groups, a shared expert
DSV3 = dict(model_type="deepseek_v3", vocab_size=320, hidden_size=32, num_layers=3, num_attention_heads=4,
            num_query_groups=4, head_dim=8, ffn_hidden_size=64, num_experts=8, moe_ffn_hidden_size=16,
            moe_router_topk=4, moe_first_k_dense=1, moe_shared_expert_ffn_hidden_size=16, moe_router_num_groups=4,
            moe_router_group_topk=2, moe_routed_scaling_factor=2.5, moe_aux_loss_coeff=0.0, q_lora_rank=24,
            kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, rope_theta=10000.0, max_position_embeddings=32)


_TP1_STEP = {}  # (model, init checkpoint) -> the TP 1 reference step's (rows, weights), shared by its layouts


@pytest.mark.parametrize("model,parallel", [(TRAIN_DENSE, {"tensor": 2}), (TRAIN_DENSE, {"pipeline": 2}),
                                            (TRAIN_MOE, {"expert": 2}), (TRAIN_MOE, {"tensor": 2}),
                                            (TRAIN_MOE, {"pipeline": 2}),
                                            ({**TRAIN_DENSE, "num_layers": 5},
                                             {"pipeline": 2, "first_stage_layers": 3}),
                                            (TRAIN_DENSE, {"context": 2}), (TRAIN_MOE, {"context": 2}),
                                            ({**TRAIN_DENSE, "num_layers": 8},
                                             {"pipeline": 3, "virtual": 2, "first_stage_layers": 2,
                                              "last_stage_layers": 2}),
                                            (DSV3, {"tensor": 2}), (DSV3, {"pipeline": 2, "first_stage_layers": 1})],
                         ids=["dense-tp2", "dense-pp2", "moe-ep2", "moe-tp2", "moe-pp2", "dense-pp2-uneven-3+2",
                              "dense-cp2", "moe-cp2", "dense-pp3-vp2-uneven-2+4+2", "dsv3-tp2", "dsv3-pp2-uneven-1+2"])
def test_parallel_training_steps_equal_tp1(dist_pools, tmp_path, model, parallel):
    init = init_checkpoint(tmp_path, model, dist_pools)
    # one RL step (one optimizer update over 6 micro-batches) from the same weights on the same rollouts; after
    # the update MoE routing may flip for a token whose top-k scores tie to fp32 precision, so one update it is
    one = dict(steps=1, minibatches=1)
    key = (json.dumps(model, sort_keys=True), str(init))  # the TP 1 step, once per model (seeded: the same rows)
    if key not in _TP1_STEP:
        _TP1_STEP[key] = dist_pools(1).run(rank_train, shared=(train_cfg(model, {}, init, **one),
                                                               str(tmp_path / "tp1")))[0]
    ref_rows, ref_state = _TP1_STEP[key]
    world = math.prod(parallel.get(k, 1) for k in ("tensor", "pipeline", "context", "expert"))
    results = dist_pools(world).run(rank_train, shared=(train_cfg(model, parallel, init, **one), str(tmp_path / "par")))
    compare_rows(results[0][0], ref_rows, sampled_after_update=False)
    assert any(r.get("train/loss") for r in ref_rows)
    for _, state in results:
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], atol=2e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    # the weights moved: real optimizer steps happened
    from megatron_pdm.models import load_hf_checkpoint

    init_state, _ = load_hf_checkpoint(init)
    assert max(float((ref_state[k] - init_state[k]).abs().max()) for k in ref_state) > 1e-3


@pytest.mark.parametrize("objective", [
    {"aggregation": "seq_mean_token_mean", "correction": "tis"},
    # the per-sequence sums over the CP group (a geometric-mean correction, a k3 rejection test), the reference
    # policy's forward on context shards (a KL penalty) and the entropy bonus's backward on them
    {"aggregation": "seq_mean_token_mean", "correction": "tis", "correction_level": "geometric", "rejection": "k3",
     "rejection_threshold": 1.0, "kl_coef": 0.05, "kl_type": "k3+", "entropy_coef": 0.01}],
    ids=["tis", "geometric-rejection-kl-entropy"])
def test_context_parallel_splits_sequences_exactly(dist_pools, tmp_path, objective):
    """CP 2 where sequences really split over the two ranks: a random model writes 8-token responses after 4-token
    prompts, so with 12 columns in 4 chunks (rank 0: chunks 0 and 3, rank 1: chunks 1 and 2) every response has
    6 tokens on rank 1 and 2 on rank 0. A user reward (response length mod 3) gives nonzero advantages. On the paths
    where the split matters, seq_mean_token_mean (each token weighted by its whole sequence's loss tokens) and a
    TIS correction (pi_old per context shard; two minibatches, the second after an update), the step equals CP 1."""
    cfg = ModelConfig(**TRAIN_DENSE)
    init = tmp_path / "random"
    save_hf_checkpoint(init, canonical_hf_state(hf_model(cfg, seed=5).state_dict()), cfg)
    reward = tmp_path / "reward.py"
    reward.write_text("def score(response, answer, metadata):\n    return float(len(response) % 3)\n")

    def run(parallel, name, world):
        c = train_cfg(TRAIN_DENSE, parallel, init, objective, steps=1, eval_prompts=2)
        c = replace(c, rollout=replace(c.rollout, max_new_tokens=8), data=replace(c.data, reward=f"{reward}:score"))
        return dist_pools(world).run(rank_train, shared=(c, str(tmp_path / name)))

    ref_rows, ref_state = run({}, "cp1", 1)[0]
    results = run({"context": 2}, "cp2", 2)
    assert ref_rows[1]["train/response_length"] > 7 and ref_rows[1]["train/loss"] != 0
    compare_rows(results[0][0], ref_rows, sampled_after_update=False)
    for key in ("correction/log_weight_mean", "correction/rejected_frac", "policy/kl_ref"):
        if objective.get("kl_coef"):
            assert results[0][0][1][key] == pytest.approx(ref_rows[1][key], rel=1e-4, abs=1e-6), key
    for _, state in results:
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], atol=2e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def test_mismatch_correction_uses_step_start_logprobs(dist_pools, tmp_path):
    init = init_checkpoint(tmp_path, TRAIN_DENSE, dist_pools)
    run = lambda name, objective, **train: dist_pools(2).run(  # noqa: E731
        rank_train, shared=(train_cfg(TRAIN_DENSE, {"tensor": 2}, init, objective, steps=1, **train),
                            str(tmp_path / name)))[0][0]
    plain = run("plain", {"mask": "ppo"}, minibatches=1)
    tis = run("tis", {"mask": "ppo", "correction": "tis"}, minibatches=1)
    # fp32 rollouts from the same weights: pi_old (the step-start forward pass) equals mu to fp32 rounding, so the
    # correction weight is 1 and pi / pi_old is pi / mu: the same loss and metrics
    compare_rows(tis, plain, sampled_after_update=False)
    step = plain[1]
    assert step["mismatch_start/kl_k3"] < 1e-6 and step["mismatch_start/abs_log_ratio_p99"] < 1e-3
    assert abs(step["mismatch_start/kl_topk"]) < 1e-6 and "mismatch/kl_topk" in step
    assert step["mismatch/abs_log_ratio_p99"] >= step["mismatch_start/abs_log_ratio_p99"]
    # two minibatches: the second is scored against pi_old after the first update moved pi
    two = run("tis2", {"mask": "ppo", "correction": "tis"}, minibatches=2)[1]
    assert two["mismatch/kl_k3"] > two["mismatch_start/kl_k3"] and math.isfinite(two["train/loss"])


@pytest.mark.parametrize("model,parallel,train", [
    (TRAIN_MOE, {"tensor": 2}, {}), (TRAIN_MOE, {"pipeline": 2}, {}),
    # interleaved: each model chunk replays its own layers' routing; one supervised warm-start step goes through
    # the interleaved schedule with its one micro-batch cut into PP
    ({**TRAIN_MOE, "num_layers": 6}, {"pipeline": 3, "virtual": 2}, {"warm_start_steps": 1})],
    ids=["tp2", "pp2", "pp3-vp2"])
def test_routed_expert_replay_in_training(dist_pools, tmp_path, model, parallel, train):
    """R3: the fp32 engine routes as megatron does, so replaying its routing changes nothing; the run goes
    through the replay path (the engine's routed experts, megatron's RouterReplay; per stage under PP)."""
    init = init_checkpoint(tmp_path, model, dist_pools)
    world = math.prod(parallel.values())
    cfg = lambda **rollout: config_from_dict({  # noqa: E731
        **train_cfg(model, parallel, init, steps=1, minibatches=1, **train).to_dict(),
        "rollout": {"n": 4, "max_new_tokens": 3, **rollout}})
    plain = dist_pools(world).run(rank_train, shared=(cfg(), str(tmp_path / "plain")))[0][0]
    r3 = dist_pools(world).run(rank_train, shared=(cfg(routed_experts=True), str(tmp_path / "r3")))[0][0]
    compare_rows(r3, plain, sampled_after_update=False)
    with pytest.raises(ValueError, match="rollout.routed_experts: true, but the model has no MoE layers"):
        config_from_dict({"model": TRAIN_DENSE, "rollout": {"routed_experts": True}})


def test_resume_continues_to_the_same_metrics(dist_pools, tmp_path):
    init = init_checkpoint(tmp_path, TRAIN_DENSE, dist_pools)
    cfg = train_cfg(TRAIN_DENSE, {"tensor": 2}, init, steps=4, checkpoint_every=2, keep_last=1)
    straight, s_state = dist_pools(2).run(rank_train, shared=(cfg, str(tmp_path / "straight")))[0]
    stopped = train_cfg(TRAIN_DENSE, {"tensor": 2}, init, steps=2, checkpoint_every=2, keep_last=1)
    dist_pools(2).run(rank_train, shared=(stopped, str(tmp_path / "resumed")))
    resumed, r_state = dist_pools(2).run(rank_train, shared=(cfg, str(tmp_path / "resumed"), True))[0]
    compare_rows(resumed, straight)
    for k in s_state:
        torch.testing.assert_close(r_state[k], s_state[k], atol=1e-6, rtol=1e-6)
    ckpts = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir())
    assert ckpts == ["step_00000004"]  # keep_last = 1, and no temporary left behind
    with pytest.raises(RuntimeError, match="holds checkpoints of an earlier run"):
        dist_pools(2).run(rank_train, shared=(cfg, str(tmp_path / "resumed")))


def test_kl_penalty_to_the_reference_and_entropy_bonus(dist_pools, tmp_path):
    """objective.kl_coef keeps the weights RL started from as a frozen reference (forward through megatron's
    pipeline schedule, at PP 2 here): at the first update pi is pi_ref, so the logged KL is 0 exactly, then it grows;
    the reference travels in the checkpoints, so a resumed run equals the straight one (a reference rebuilt from
    the resumed weights would log 0 again at step 3), also offloaded to host memory; a checkpoint without one is
    refused, naming why."""
    init = init_checkpoint(tmp_path, TRAIN_DENSE, dist_pools)
    objective = {"kl_coef": 0.05, "kl_type": "low_var_kl", "entropy_coef": 0.01}
    cfg = lambda steps, objective=objective: train_cfg(TRAIN_DENSE, {"pipeline": 2}, init, objective, steps=steps,  # noqa: E731
                                                  minibatches=1, checkpoint_every=2)
    straight = dist_pools(2).run(rank_train, shared=(cfg(3), str(tmp_path / "straight")))[0][0]
    assert straight[1]["policy/kl_ref"] == 0.0 and straight[2]["policy/kl_ref"] > 0.0
    assert straight[3]["policy/kl_ref"] > 0.0 and all(r["policy/entropy"] > 0 for r in straight[1:])
    # the resumed run keeps its reference in host memory (objective.ref_offload): saved from and loaded into it
    offload = {**objective, "ref_offload": True}
    dist_pools(2).run(rank_train, shared=(cfg(2, offload), str(tmp_path / "resumed")))
    resumed = dist_pools(2).run(rank_train, shared=(cfg(3, offload), str(tmp_path / "resumed"), True))[0][0]
    compare_rows(resumed, straight)
    assert resumed[3]["policy/kl_ref"] == pytest.approx(straight[3]["policy/kl_ref"], rel=1e-4)
    dist_pools(2).run(rank_train, shared=(cfg(2, {}), str(tmp_path / "plain")))
    with pytest.raises(RuntimeError, match=r"reference\.\*: not in the checkpoint \(written with objective.kl_coef"):
        dist_pools(2).run(rank_train, shared=(cfg(3), str(tmp_path / "plain"), True))


def test_exact_kl_to_the_reference(dist_pools, tmp_path):
    """objective.kl_type exact: the reference's last hidden states at the response positions (gathered over sequence
    parallelism at TP 2; on the last stage at PP 2) times its output weight are its logits shard. At the first update
    pi is pi_ref, so the exact KL is 0 to rounding; then it grows, equal across layouts, the PP 2 run with its
    reference offloaded to host memory but for the output weight the loss multiplies by."""
    init = init_checkpoint(tmp_path, TRAIN_DENSE, dist_pools)
    objective = {"kl_coef": 0.05, "kl_type": "exact"}
    tp = dist_pools(2).run(rank_train, shared=(train_cfg(TRAIN_DENSE, {"tensor": 2}, init, objective, steps=2,
                                                         minibatches=1), str(tmp_path / "tp")))[0][0]
    pp = dist_pools(2).run(rank_train, shared=(train_cfg(TRAIN_DENSE, {"pipeline": 2}, init,
                                                         {**objective, "ref_offload": True}, steps=2, minibatches=1),
                                               str(tmp_path / "pp")))[0][0]
    for rows in (tp, pp):
        # fp32 rounding: each term pi_i (log pi_i - log pi_ref,i) of two equal distributions carries about eps x
        # |log pi_i| <= 1.2e-7 x 10, and the terms cancel to that in the sum (2.3e-9 measured)
        assert abs(rows[1]["policy/kl_ref"]) < 1e-6 and rows[2]["policy/kl_ref"] > 1e-2  # 0.21
    compare_rows(pp, tp)
    assert pp[2]["policy/kl_ref"] == pytest.approx(tp[2]["policy/kl_ref"], rel=1e-4)


def test_host_weights_keep_their_host_storage():
    """objective.ref_offload's mechanics on a CPU (on CUDA `on_device` copies to the GPU, here to another CPU tensor;
    the swap is the same code): parameters live in host copies made once and are back in that same storage after a
    pass; what changed on the device copy is dropped, or kept with writeback. (The meta device cannot stand in for a
    GPU: `param.data` refuses a meta tensor.)"""
    from megatron_pdm.train.step import HostWeights

    layer = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in layer.parameters()]
    held = HostWeights([layer], torch.device("cpu"))
    host = [h.data_ptr() for h in held.host]
    assert [p.data.data_ptr() for p in layer.parameters()] == host
    assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before, strict=True))
    with held.on_device(), torch.no_grad():  # a device copy: what changes there is dropped
        assert layer.weight.data.data_ptr() != host[0]
        layer.weight.fill_(2.0)
    assert torch.equal(layer.weight, before[0]) and [p.data.data_ptr() for p in layer.parameters()] == host
    with held.on_device(writeback=True), torch.no_grad():  # a checkpoint loaded into the device copy is kept
        layer.weight.fill_(2.0)
    assert (held.host[0] == 2.0).all() and [p.data.data_ptr() for p in layer.parameters()] == host


@pytest.mark.e2e
def test_cli_runs_a_short_training_job(tmp_path, monkeypatch):
    """`megatron-pdm train` from this process (its two ranks spawned as the command spawns them; the command's own
    interpreter is what the sigkill test runs)."""
    from megatron_pdm.cli import main

    run_dir = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"), "--run-dir", str(run_dir),
                 "train.steps=3", "train.eval_every=3", "train.warm_start_steps=2", "train.prompts_per_step=8",
                 "train.checkpoint_every=3"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval/reward" in rows[0] and "eval/reward" in rows[-1]
    assert all(0.0 <= r["train/reward"] <= 1.0 for r in rows[1:])
    assert all(r["perf/rollout_bytes_per_rank"] > 0 for r in rows[1:]) and rows[1]["train/loss"] != 0
    assert (run_dir / "plot.png").stat().st_size > 1000
    assert (run_dir / "config.yaml").is_file()
    assert any((run_dir / "tensorboard").iterdir())
    assert (run_dir / "checkpoints" / "step_00000003" / "complete").is_file()


@pytest.mark.e2e
def test_cli_input_errors_are_one_line(tmp_path, capsys):
    """A bad value prints `<command>: <field>: ...` and exits 2 (as `plan` does), no traceback: train before any
    process is spawned (analyze: tests/train/test_analyze.py, sweep: tests/cluster/test_sweep.py); export reads the
    checkpoint's config; the real entry point once, for its whole stderr. A rank's bad-input error comes back from
    `launch` once, as its own class (not one traceback per rank); a bug keeps torch's exception and its traceback."""
    import torch.multiprocessing as mp

    from megatron_pdm.cli import main
    from megatron_pdm.train.launch import launch

    tiny = str(ROOT / "examples" / "tiny_cpu.yaml")
    assert main(["train", "--config", tiny, "--run-dir", str(tmp_path / "t"), "objective.mask=nope"]) == 2
    assert "objective.mask: 'nope' is not one of" in one_line(capsys, "train")
    assert main(["train", "--config", tiny, "--nproc", "3", "--run-dir", str(tmp_path / "t")]) == 2
    assert "must divide the 3 training GPUs (--nproc 3)" in one_line(capsys, "train")
    assert not (tmp_path / "t").exists()
    bad = load_config(tiny).to_dict()
    bad["objective"]["mask"] = "nope"
    ckpt = published_checkpoint(tmp_path / "run", bad)
    assert main(["export", str(ckpt), "--to", str(tmp_path / "hf")]) == 2
    assert f"{ckpt / 'config.yaml'}: objective.mask: 'nope'" in one_line(capsys, "export")
    done = subprocess.run([sys.executable, "-m", "megatron_pdm.cli", "train", "--config", tiny, "objective.mask=nope"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("train: objective.mask: 'nope'"), done.stderr
    assert done.stderr.count("\n") == 1 and not (tmp_path / "runs").exists()
    # regression: --seeds 0 divided by zero seeds after the whole study
    assert main(["analyze", "--config", tiny, "--seeds", "0"]) == 2
    assert "analyze: --seeds: expected an integer >= 1, got 0" in one_line(capsys, "analyze")
    with pytest.raises(FileExistsError, match="File exists"):  # every rank raised it; one error, no traceback
        launch(os.makedirs, (str(tmp_path),), None, nproc=2)
    with pytest.raises(mp.ProcessRaisedException, match="TypeError"):  # a bug: the rank's traceback
        launch(os.makedirs, (None,), None, nproc=1)


@pytest.mark.e2e
def test_train_refuses_an_earlier_run_without_touching_its_directory(dist_pools, tmp_path, capsys):
    """`train` into a run directory that holds checkpoints, without --resume: one line naming the directory and
    --resume, and every file of the directory as it was (the regression: config.yaml was overwritten with the new
    config before the refusal). The CLI refuses before spawning; the trainer (torchrun, the API) refuses before
    its logger writes anything."""
    from megatron_pdm.cli import main

    run = tmp_path / "run"
    published_checkpoint(run, {"earlier": "run"})
    (run / "config.yaml").write_text("the earlier run's config\n")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    files = lambda: {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}  # noqa: E731
    before = files()
    tiny = ["--config", str(ROOT / "examples" / "tiny_cpu.yaml"), "parallel.tensor=1", "train.warm_start_steps=0"]
    assert main(["train", "--run-dir", str(run), *tiny]) == 2
    assert f"train: {run}: holds checkpoints of an earlier run; pass --resume" in one_line(capsys, "train")
    assert files() == before
    assert main(["train", "--run-dir", str(tmp_path / "new"), "--resume", *tiny]) == 2
    assert "--resume: no complete checkpoint under" in one_line(capsys, "train")
    assert not (tmp_path / "new").exists()
    cfg = train_cfg(TRAIN_DENSE, {}, tmp_path / "no-init", steps=1)
    with pytest.raises(RuntimeError, match="holds checkpoints of an earlier run"):
        dist_pools(1).run(rank_train, shared=(cfg, str(run)))
    assert files() == before


def test_scientific_notation_is_a_number(tmp_path):
    """YAML 1.1 (PyYAML) reads 3e-3 as a string, which a user typing optim.lr=3e-3 would meet as "expected a
    number": overrides and config files read YAML 1.2's floats."""
    (tmp_path / "c.yaml").write_text("optim:\n  lr: 5e-4\n  adam_eps: 1E-8\n")
    cfg = load_config(tmp_path / "c.yaml", ["optim.weight_decay=1e-2", "train.seed=12"])
    assert (cfg.optim.lr, cfg.optim.adam_eps, cfg.optim.weight_decay, cfg.train.seed) == (5e-4, 1e-8, 1e-2, 12)
    assert load_config(None, ["logging.wandb_project=1e5x"]).logging.wandb_project == "1e5x"  # not a number


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="config: unknown section.s. trainer"):
        config_from_dict({"trainer": {}})
    with pytest.raises(ValueError, match="train: unknown key.s. stpes"):
        config_from_dict({"train": {"stpes": 3}})
    with pytest.raises(ValueError, match=r"train.steps: expected an integer >= 1, got 0"):
        config_from_dict({"train": {"steps": 0}})
    with pytest.raises(ValueError, match="objective.mask: 'clip'"):
        config_from_dict({"objective": {"mask": "clip"}})
    with pytest.raises(ValueError, match=r"rollout.temperature: 0 must be > 0.0"):
        config_from_dict({"rollout": {"temperature": 0}})
    with pytest.raises(ValueError, match="train.minibatches: 3 must divide"):
        config_from_dict({"train": {"minibatches": 3}})
    with pytest.raises(ValueError, match="data.train_path: required"):
        config_from_dict({"data": {"task": "dataset"}})
    with pytest.raises(ValueError, match="override 'steps=3': expected section.key=value"):
        load_config(None, ["steps=3"])
    cfg = load_config(ROOT / "examples" / "tiny_cpu.yaml", ["objective.mask=dppo", "train.steps=7"])
    assert cfg.objective.mask == "dppo" and cfg.train.steps == 7 and cfg.parallel.tensor == 2
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_temperature_is_one_setting(caplog):
    """rollout.temperature is the sampling T and the T of the trainer's pi; a config that still sets the removed
    objective.temperature loads with a warning when it agrees, and is an error naming both when it does not."""
    assert config_from_dict({"rollout": {"temperature": 0.7}}).rollout.temperature == 0.7
    assert "temperature" not in config_from_dict({}).to_dict()["objective"]
    with caplog.at_level(logging.WARNING, logger="megatron_pdm.train.config"):
        for d in ({"objective": {"temperature": 0.7}},
                  {"objective": {"temperature": 0.7}, "rollout": {"temperature": 0.7}}):
            cfg = config_from_dict(d)
            assert cfg.rollout.temperature == 0.7 and not hasattr(cfg.objective, "temperature")
    assert "objective.temperature: removed; read as rollout.temperature = 0.7" in caplog.text
    with pytest.raises(ValueError, match=r"objective.temperature: 1.0 differs from rollout.temperature 0.7; the "
                                         r"temperature is one setting, rollout.temperature"):
        config_from_dict({"objective": {"temperature": 1.0}, "rollout": {"temperature": 0.7}})
    with pytest.raises(ValueError, match=r"objective.temperature: 0.5 differs from rollout.temperature 1.0"):
        load_config(ROOT / "examples" / "tiny_cpu.yaml", ["objective.temperature=0.5"])  # an old override


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "examples").glob("*.yaml")
                                         # these need the checkpoint their script builds: their own tests run it
                                         if p.name not in ("qwen3_vocab_tiny.yaml", "tiny_deepseek_v3.yaml")),
                         ids=lambda p: p.name)
def test_example_configs_load(path):
    cfg = load_config(path)
    assert cfg.train.steps >= 1


# 16 rows in 4 micro-batches of 4: every layout (DP = 2 too) sees the same micro-batches, and the load-balancing
# loss is a function of a whole micro-batch's routing
MOE_AUX_STEP = dict(steps=1, minibatches=1, micro_batch_size=4)


@pytest.fixture(scope="module")
def moe_aux_reference(dist_pools, tmp_path_factory):
    """An MoE model with a load-balancing loss (coefficient 0.1), warm-started, and one single-rank RL step
    from it: the reference every layout's step must equal."""
    tmp = tmp_path_factory.mktemp("moe_aux")
    model = dict(TRAIN_MOE, moe_aux_loss_coeff=0.1)
    init = init_checkpoint(tmp, model, dist_pools)
    rows, state = dist_pools(1).run(rank_train, shared=(train_cfg(model, {}, init, **MOE_AUX_STEP),
                                                        str(tmp / "ref")))[0]
    return model, init, rows, state


@pytest.mark.parametrize("parallel,world", [({"pipeline": 2}, 2), ({"tensor": 2}, 2), ({"expert": 2}, 2),
                                            ({"context": 2}, 2), ({"tensor": 2, "context": 2}, 4),
                                            ({"tensor": 2, "pipeline": 2}, 4), ({"context": 2}, 4)],
                         ids=["pp2", "tp2", "ep2", "cp2", "tp2-cp2", "tp2-pp2", "cp2-dp2"])
def test_moe_load_balancing_loss_equal_across_layouts(dist_pools, tmp_path, moe_aux_reference, parallel, world):
    """The load-balancing loss weighs the same at every layout: megatron's pipeline schedule resets its scale per
    micro-batch, with per-token losses the router multiplies it by a token count, and padding stays out of it.
    The four-rank layouts run paths two ranks miss: sequence parallelism inside context shards (each CP rank's
    S / CP columns split over TP, the padding mask cut with them, megatron counting the TP x CP group's tokens),
    the padding mask cut over TP on a later pipeline stage, losses and gradients summed over DP x CP, and the
    rollout data reaching each replica's second rank through the replica broadcast."""
    model, init, ref_rows, ref_state = moe_aux_reference
    results = dist_pools(world).run(rank_train, shared=(train_cfg(model, parallel, init, **MOE_AUX_STEP),
                                                        str(tmp_path / "p")))
    compare_rows(results[0][0], ref_rows, sampled_after_update=False)
    for _, state in results:
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], atol=2e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def rank_load_balancing_grads(group, cfg, run_dir, ids):
    """The router gradients of one trainer update whose policy loss is zero (only the load-balancing loss
    trains), and those of megatron's own weighting: coefficient x the mean over micro-batches of each
    micro-batch's aux loss (calculate_per_token_loss off, scale 1 / micro-batches)."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_pdm.models import build_model, forward_logits
    from megatron_pdm.objectives import Metrics
    from megatron_pdm.train.trainer import Trainer

    trainer = Trainer(cfg, Path(run_dir))
    reference = build_model(cfg.model, trainer.parallel)
    reference.load_state_dict(trainer.chunks[0].state_dict())
    mbs = [SimpleNamespace(input_ids=ids[i:i + 3]) for i in range(0, len(ids), 3)]  # sizes 3, 3, 1
    trainer.learner.update(mbs, lambda mb, logits: ((logits * 0).sum(), Metrics()))
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 1 / len(mbs)))
    for mb in mbs:
        (forward_logits(reference, mb.input_ids) * 0).sum().backward()
    ours = {n: p.main_grad.clone() for n, p in trainer.chunks[0].named_parameters() if "router" in n}
    theirs = {n: p.grad.clone() for n, p in reference.named_parameters() if "router" in n}
    trainer.parallel.close()
    return ours, theirs


def test_load_balancing_loss_is_the_micro_batch_mean(dist_pools, tmp_path):
    model = {**TRAIN_MOE, "moe_aux_loss_coeff": 0.1, "tokenizer": str(ARITHMETIC_TOKENIZER)}
    cfg = config_from_dict({"model": model, "train": {"prompts_per_step": 4, "minibatches": 1}})
    ids = torch.randint(0, 288, (7, 10), generator=torch.Generator().manual_seed(0))
    ours, theirs = dist_pools(1).run(rank_load_balancing_grads, shared=(cfg, str(tmp_path), ids))[0]
    assert ours.keys() == theirs.keys() and len(ours) == TRAIN_MOE["num_layers"]
    for k in ours:
        assert float(theirs[k].abs().max()) > 1e-4
        torch.testing.assert_close(ours[k], theirs[k], atol=1e-7, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_config_refuses_at_load_what_the_trainer_would_refuse():
    # the rollout engines return mu's top-K only: an exact divergence cannot be computed, whatever the mask
    for divergence, extra in (("kl", {}), ("reverse_kl", {"mask": "ppo"}), ("tv", {"mask": "dppo"})):
        with pytest.raises(ValueError, match=rf"objective.divergence: '{divergence}' is an exact \(full-vocabulary\) "
                                             r"divergence .* use one of binary_tv, binary_kl, topk_kl, topk_tv"):
            config_from_dict({"objective": {"divergence": divergence, **extra}})
    with pytest.raises(ValueError, match=r"rollout engine \('sglang'; every engine alike\)"):
        config_from_dict({"objective": {"divergence": "kl"}, "rollout": {"engine": "sglang",
                                                                         "sglang": {"num_engines": 1}}})
    # minibatches that do not split over DP: on the cluster the config names...
    preset = ROOT / "examples" / "presets" / "qwen3_235b_a22b.yaml"
    with pytest.raises(ValueError, match=r"train.prompts_per_step x rollout.n / train.minibatches = 256 x 16 / 8 = 512 "
                                         r"sequences per minibatch must be divisible by the data-parallel size 24 = "
                                         r"192 ranks / \(parallel.tensor 4 x pipeline 2 x context 1\), with "
                                         r"\(cluster.nodes 32 - cluster.rollout_nodes 8\)"):
        load_config(preset, ["cluster.nodes=32", "cluster.rollout_nodes=8", "cluster.gpus_per_node=8",
                             "parallel.pipeline=2", "parallel.first_stage_layers=0", "parallel.last_stage_layers=0",
                             "rollout.sglang.release_memory=false"])
    with pytest.raises(ValueError, match=r"must divide the 20 training GPUs"):  # TP x PP = 32 does not tile 20
        load_config(preset, ["cluster.gpus_per_node=4", "cluster.nodes=9", "cluster.rollout_nodes=4"])
    # ...and locally, over the processes `megatron-pdm train` spawns (TP x PP x CP x EP): EP 2 is DP 2 here
    with pytest.raises(ValueError, match=r"= 3 sequences per minibatch must be divisible by the data-parallel size 2 .*"
                                         r"the local run's parallel.tensor x pipeline x context x expert = 2 "
                                         r"processes"):
        config_from_dict({"model": TRAIN_MOE, "parallel": {"expert": 2}, "train": {"prompts_per_step": 3},
                          "rollout": {"n": 1}})
    # a local run is not held to a cluster's GPU count: 6 sequences on 2 processes (TP 2, DP 1) are fine, while the
    # default cluster section (8 GPUs, DP 4) would refuse them, as `submit` does
    local = config_from_dict({"parallel": {"tensor": 2}, "train": {"prompts_per_step": 3}, "rollout": {"n": 2}})
    assert not local.on_cluster and local.training_world_size()[0] == 2
    with pytest.raises(ValueError, match="data-parallel size 4 = 8 ranks"):
        local.check_world_size(local.cluster.training_gpus, local.cluster.describe_training_gpus())


def test_interleaved_schedule_micro_batch_rules():
    """With virtual stages every minibatch is cut into at least PP micro-batches, a multiple of PP where every DP
    rank's rows allow (halving the largest; the sums over micro-batches are unchanged), and megatron's group size
    per chunk is the smallest one its interleaved schedule accepts: g in [PP, M] with M % g == 0 or >= PP."""
    from megatron_pdm.train.step import at_least, interleave_group

    assert at_least([6], 3) == [2, 1, 3] and at_least([2, 5], 4) == [2, 2, 1, 2]
    assert at_least([3, 3, 3], 3) == [3, 3, 3] and sum(at_least([7], 5)) == 7
    assert at_least([3, 3, 3, 3], 3) == [2, 1, 2, 1, 3, 3]  # rounded up to a multiple of PP
    assert at_least([3, 3, 3, 3], 3, fewest=5) == [3, 3, 3, 3]  # another DP rank has too few rows for 6
    with pytest.raises(ValueError, match=r"at least parallel.pipeline = 4 micro-batches, and a DP rank's minibatch "
                                         r"has 3 sequences"):
        at_least([2, 1], 4)
    for pp in (3, 4, 8):
        for m in range(pp, 4 * pp):
            g = interleave_group(m, pp)
            assert pp <= g <= m and (m % g == 0 or m % g >= pp)
            assert all(m % h and m % h < pp for h in range(pp, g))  # none smaller is accepted
    assert interleave_group(6, 3) == 3 and interleave_group(7, 3) == 4 and interleave_group(5, 3) == 5


@pytest.mark.parametrize("distributed", [False, True], ids=["optimizer", "distributed-optimizer"])
def test_hf_init_reaches_the_optimizers_main_weights(dist_pools, tmp_path, distributed):
    """bf16 training from an HF checkpoint without a warm start: megatron's mixed-precision optimizers keep fp32
    main weights, copied from the model when the optimizer is built (before the checkpoint is loaded). The
    regression: the first update wrote the random initial weights back into the model. At a negligible learning
    rate the weights after one step are the checkpoint's, to bf16 rounding (|w| < 2: 2^-8 relative, under 1e-2)."""
    from megatron_pdm.models import load_hf_checkpoint

    init = init_checkpoint(tmp_path, TRAIN_DENSE, dist_pools)
    cfg = config_from_dict({**train_cfg(TRAIN_DENSE, {}, init, steps=1, minibatches=1).to_dict(),
                            "precision": {"train": "bf16"},
                            "optim": {"lr": 1e-12, "distributed_optimizer": distributed}})
    _, state = dist_pools(1).run(rank_train, shared=(cfg, str(tmp_path / "bf16")))[0]
    init_state, _ = load_hf_checkpoint(init)
    for k in init_state:
        torch.testing.assert_close(state[k].float(), init_state[k].float(), atol=1e-2, rtol=1e-2,
                                   msg=lambda m, k=k: f"{k}: {m}")


def test_virtual_stages_need_pipeline_many_sequences_per_rank():
    with pytest.raises(ValueError, match=r"parallel.virtual: 2 virtual stages run megatron's interleaved schedule, "
                                         r"which needs at least parallel.pipeline = 3 micro-batches per minibatch; "
                                         r"train.prompts_per_step x rollout.n / train.minibatches = 2 sequences over "
                                         r"DP 1 leave 2 per rank"):
        config_from_dict({"model": {**TRAIN_DENSE, "num_layers": 6}, "parallel": {"pipeline": 3, "virtual": 2},
                          "rollout": {"n": 2}, "train": {"prompts_per_step": 1, "minibatches": 1}})


def test_warm_start_gives_every_data_parallel_rank_rows():
    """Regression: the warm start drew 64 rows and gave each DP rank 64 // DP of them: none at DP > 64 (an empty
    micro-batch), and the remainder's tokens still counted in the normaliser when DP does not divide 64."""
    from megatron_pdm.train.init import warm_start_rows

    assert warm_start_rows(1) == 64 and warm_start_rows(2) == 64 and warm_start_rows(3) == 66
    assert warm_start_rows(128) == 128 and warm_start_rows(100) == 100
    assert warm_start_rows(32, per_rank=4) == 128  # virtual stages at PP 4: 4 rows, so 4 micro-batches, a rank


def test_metrics_with_a_torn_last_line_still_resume(tmp_path):
    """Regression: a kill while metrics.jsonl's last line was written left rank 0 unable to parse it, and every
    --auto-resume then failed with `Expecting value` (no file named). The cut line is dropped (the resumed run logs
    that step again); a bad line before the last is an error naming the file and the line."""
    from megatron_pdm.train.logging import read_metrics

    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "train/lo')
    assert read_metrics(f) == [{"step": 0}, {"step": 1}]
    f.write_text('{"step": 0}\n{"ste\n{"step": 2}\n')
    with pytest.raises(ValueError, match=f"{f}: line 2 is not JSON"):
        read_metrics(f)


@pytest.mark.parametrize("bad", ["[1]", "null", '{"train/reward": 1.0}', '{"step": "3"}'])
def test_metrics_rows_that_are_json_but_not_rows_name_the_line(tmp_path, bad):
    """A metrics.jsonl line that is JSON but not a row (an object with an integer step) is an error naming the file
    and the line when the run resumes (the regression: a TypeError traceback from the logger's truncate)."""
    from megatron_pdm.train.logging import read_metrics

    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 0}\n' + bad + '\n{"step": 2}\n')
    with pytest.raises(ValueError, match=f"{f}: line 2 is not a metrics row \\(an object with an integer 'step'\\)"):
        read_metrics(f)


def test_the_run_logger_replaces_its_files_whole(tmp_path):
    """`truncate` (a run's start or resume) rewrites config.yaml and metrics.jsonl through a temporary file and a
    rename: a write that stops part-way, here at the file-size limit a full disk would set, leaves metrics.jsonl as
    it was (the regression: it was rewritten in place, and a kill or a full disk then lost its rows)."""
    import resource
    import signal

    import yaml

    from megatron_pdm.train.logging import RunLogger, read_metrics

    cfg = config_from_dict({})
    rows = [{"step": i, "train/reward": 0.25, "note": "x" * 60} for i in range(200)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    logger = RunLogger(tmp_path, cfg, enabled=True)
    config_text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    limit = len(config_text.encode()) + 64  # config.yaml fits, metrics.jsonl's 100 rows (10 KB) do not
    assert len(json.dumps(rows[:100])) > 2 * limit
    old = metrics.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG, not the signal's kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with pytest.raises(OSError):
            logger.truncate(after_step=99)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert metrics.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "metrics.jsonl"]  # no temporary file left
    logger.truncate(after_step=99)
    assert read_metrics(metrics) == rows[:100]
    assert (tmp_path / "config.yaml").read_text() == config_text
