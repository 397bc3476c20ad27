"""`megatron-pdm compare` on two small recorded runs (30 steps each of the ppo and dppo examples)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pdm.cluster.compare import compare, load_run, summarize

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "tests" / "data" / "runs"


def _eval(path):
    return [r["eval/reward"] for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines())
            if "eval/reward" in r]


@pytest.mark.e2e
def test_compare_two_recorded_runs(tmp_path):
    rows = compare([RUNS / "ppo", RUNS / "dppo"], out_dir=tmp_path, target=0.2)
    for row, name in zip(rows, ("ppo", "dppo"), strict=True):
        rewards = _eval(RUNS / name)
        assert row["final_eval_reward"] == rewards[-1] and row["best_eval_reward"] == max(rewards)
        assert f"[{name}, rollout float32]" in row["run"]
        mismatch = [r["mismatch/kl_k3"] for r in map(json.loads, (RUNS / name / "metrics.jsonl").read_text()
                                                       .splitlines()) if "mismatch/kl_k3" in r]
        assert row["mean_mismatch_kl"] == pytest.approx(sum(mismatch) / len(mismatch))
        assert row["collapsed"] is False
    assert (tmp_path / "compare.png").stat().st_size > 1000
    assert json.loads((tmp_path / "compare.json").read_text()) == rows
    out = subprocess.run([sys.executable, "-m", "megatron_pdm.cli", "compare", str(RUNS / "ppo"), str(RUNS / "dppo"),
                          "--out-dir", str(tmp_path / "cli")], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert "steps to 0.5" in out.stdout and "dppo" in out.stdout


def test_collapse_and_bad_runs(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    lines = [{"step": 0, "eval/reward": 0.4}, {"step": 1, "eval/reward": 0.6}, {"step": 2, "eval/reward": 0.25}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = summarize(load_run(run), target=0.5)
    assert s["collapsed"] and s["steps_to_target"] == 1 and s["final_eval_reward"] == 0.25
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/reward": 0.4}\n{"step": 1, "train/loss": null}\n')
    assert summarize(load_run(run))["collapsed"]  # a NaN (logged as null) is a collapse
    (run / "metrics.jsonl").write_text('{"eval/reward": 0.4}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: missing field 'step'"):
        load_run(run)
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        load_run(tmp_path / "nothing")


def test_compare_over_seeds(tmp_path):
    """Runs that differ only in train.seed are one row: means over seeds, a mean curve per setting."""
    import shutil

    import yaml

    for name in ("ppo", "dppo"):
        shutil.copytree(RUNS / name, tmp_path / name)
        other = tmp_path / f"{name}-seed7"
        shutil.copytree(RUNS / name, other)
        cfg = yaml.safe_load((other / "config.yaml").read_text())
        cfg["train"]["seed"] = 7
        (other / "config.yaml").write_text(yaml.safe_dump(cfg))
        rows = [json.loads(line) for line in (other / "metrics.jsonl").read_text().splitlines()]
        for r in rows:
            if "eval/reward" in r:
                r["eval/reward"] = r["eval/reward"] / 2  # the second seed does half as well
        (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dirs = [tmp_path / n for n in ("ppo", "dppo", "ppo-seed7", "dppo-seed7")]
    single = compare(dirs, out_dir=tmp_path / "single")
    rows = compare(dirs, out_dir=tmp_path / "grouped", over_seeds=True)
    assert [r["seeds"] for r in rows] == [[1234, 7], [1234, 7]]
    for row, (a, b) in zip(rows, ((single[0], single[2]), (single[1], single[3])), strict=True):
        assert row["final_eval_reward"] == pytest.approx((a["final_eval_reward"] + b["final_eval_reward"]) / 2)
        assert row["best_eval_reward"] == pytest.approx((a["best_eval_reward"] + b["best_eval_reward"]) / 2)
        assert row["mean_mismatch_kl"] == pytest.approx(a["mean_mismatch_kl"])  # the same rollouts
        assert row["collapsed"] == (a["collapsed"] or b["collapsed"]) and row["per_seed"] == [a, b]
        assert "seeds" in row["run"] and ", 7" in row["run"]
    assert (tmp_path / "grouped" / "compare.png").stat().st_size > 1000


def test_off_policy_runs_show_the_age0_mismatch_and_the_area_under_the_eval_curve(tmp_path):
    """A lagged run's step-start mismatch mixes lag with precision: compare shows the age-0 tokens' (NaN steps,
    where no token was age 0, left out; '-' when there were none), and the eval AUC is the trapezoid mean."""
    run = tmp_path / "r"
    run.mkdir()
    lines = [{"step": 0, "eval/reward": 0.2}, {"step": 10, "eval/reward": 0.4, "mismatch_start/kl_k3": 0.5,
                                               "mismatch_start/age0/kl_k3": 1e-4},
             {"step": 30, "eval/reward": 0.6, "mismatch_start/kl_k3": 0.7, "mismatch_start/age0/kl_k3": None}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = summarize(load_run(run))
    assert s["mean_mismatch_kl"] == pytest.approx(1e-4) and s["mean_mismatch_p99"] is None
    assert s["eval_auc"] == pytest.approx((10 * 0.3 + 20 * 0.5) / 30)
    lines[1]["mismatch_start/age0/kl_k3"] = None
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert summarize(load_run(run))["mean_mismatch_kl"] is None


def _eval_run(path, rewards):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": 10 * i, "eval/reward": r}) + "\n"
                                                for i, r in enumerate(rewards)))
    return load_run(path)


@pytest.mark.parametrize("rewards, collapsed", [
    ([-0.8, -0.5, -0.2], False),  # negative rewards, improving (was "collapse YES": -0.5 < 0.5 x -0.8)
    ([-0.8, -0.2, -0.6], True),  # gave back 0.4 of its 0.6 gain
    ([-0.5, -0.51, -0.9], False),  # never gained anything to lose
    ([0.4, 0.6, 0.25], True),  # rewards >= 0: below half the best so far, as before
    ([0.4, 0.6, 0.35], False),
    ([0.0, 0.0, 0.0], False),
])
def test_collapse_is_a_loss_of_more_than_half_the_gain(tmp_path, rewards, collapsed):
    from megatron_pdm.cluster.compare import collapsed_eval

    assert collapsed_eval(rewards) is collapsed
    assert summarize(_eval_run(tmp_path / "r", rewards))["collapsed"] is collapsed


def test_over_seeds_ignores_what_the_slurm_job_adds_at_run_time(tmp_path):
    """Array tasks of one setting write configs that differ in train.seed and in what the job passes at run time
    (their engines' URLs, on other nodes) or logging: one group. Another setting is another group."""
    import yaml

    from megatron_pdm.cluster.compare import RUNTIME_ONLY, group_over_seeds

    base = yaml.safe_load((RUNS / "ppo" / "config.yaml").read_text())
    runs = []
    for name, seed, node, mask in (("a", 1, "gpu-a01", "ppo"), ("b", 2, "gpu-b07", "ppo"), ("c", 1, "gpu-c01", "pdm")):
        cfg = {**base, "train": {**base["train"], "seed": seed}, "objective": {**base["objective"], "mask": mask},
               "rollout": {**base["rollout"], "sglang": {"urls": [f"http://{node}:30000"], "engine_tp": 2,
                                                         "release_memory": True}},
               "logging": {**base.get("logging", {}), "wandb_name": name}}
        _eval_run(tmp_path / name, [0.1, 0.2])
        (tmp_path / name / "config.yaml").write_text(yaml.safe_dump(cfg))
        runs.append(load_run(tmp_path / name))
    assert [[r.path.name for r in g] for g in group_over_seeds(runs)] == [["a", "b"], ["c"]]
    assert {"rollout.sglang.urls", "rollout.sglang.engine_tp", "rollout.sglang.release_memory",
            "logging"} <= set(RUNTIME_ONLY)


def test_runtime_only_keys_cover_what_the_job_script_passes():
    """Every override the rendered Slurm script adds beside the grid point's (OVERRIDES+=) is in RUNTIME_ONLY."""
    import re

    from megatron_pdm.cluster.compare import RUNTIME_ONLY
    from megatron_pdm.cluster.submit import Submission, render
    from megatron_pdm.train.config import load_config

    cfg = load_config(ROOT / "examples" / "presets" / "qwen3_4b.yaml")
    text = render(cfg, Submission(run_dir=Path("/scratch/runs/x")))
    added = re.findall(r'OVERRIDES\+=\((.*)\)', text)
    keys = set(re.findall(r'"([\w.]+)=', " ".join(added)))
    assert keys == {"rollout.sglang.urls", "rollout.sglang.engine_tp", "rollout.sglang.release_memory"}
    assert keys <= set(RUNTIME_ONLY)
