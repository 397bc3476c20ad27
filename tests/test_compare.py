"""`megatron-pdm compare` on two small recorded runs (30 steps each of the ppo and dppo examples)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pdm.compare import compare, load_run, summarize

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "tests" / "data" / "runs"


def _eval(path):
    return [r["eval/reward"] for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines())
            if "eval/reward" in r]


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
