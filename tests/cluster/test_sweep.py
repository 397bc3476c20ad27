"""`megatron-pdm sweep` locally: one run directory per grid point, a compare table over them, resume of an
interrupted sweep, and a bad grid value failing before anything runs. (The Slurm array: tests/cluster/test_slurm.py.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pdm.cluster.sweep import point_name, sweep_local

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny_cpu.yaml")
SHORT = ["train.steps=2", "train.eval_every=2", "train.warm_start_steps=1", "train.prompts_per_step=8",
         "train.eval_prompts=16", "train.checkpoint_every=2", "parallel.tensor=1"]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
def test_local_sweep_runs_every_point_then_compares(tmp_path, capsys):
    root = tmp_path / "sweep"
    out = subprocess.run([sys.executable, "-m", "megatron_pdm.cli", "sweep", "--config", TINY, "--run-root", str(root),
                          "--parallel", "2", *SHORT, "--grid", "precision.rollout=bf16,fp8", "objective.mask=pdm"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    names = ["precision.rollout-bf16_objective.mask-pdm", "precision.rollout-fp8_objective.mask-pdm"]
    assert sorted(p.name for p in root.iterdir()) == sorted([*names, "compare"])
    table = json.loads((root / "compare" / "compare.json").read_text())
    assert [r["run"].split()[0] for r in table] == names
    for name, rollout in zip(names, ("bf16", "fp8"), strict=True):
        rows = _rows(root / name)
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert f"[pdm, rollout {rollout}]" in out.stdout
        # low-precision rollouts differ from the fp32 trainer: a positive step-start mismatch, and its p99
        assert rows[1]["mismatch_start/kl_k3"] > 0 and rows[1]["mismatch_start/abs_log_ratio_p99"] > 0
    # a sweep run again continues every run from its last checkpoint (here: all finished, none started again)
    done, failed = sweep_local(TINY, ["precision.rollout=bf16,fp8", "objective.mask=pdm"], run_root=root,
                               overrides=SHORT)
    assert failed == [] and [d.name for d in done] == names
    assert capsys.readouterr().out.count("already finished") == 2
    assert [r["step"] for r in _rows(root / names[0])] == [0, 1, 2]


def test_sweep_errors(tmp_path):
    with pytest.raises(ValueError, match="precision.rollout: 'fp4' is not one of"):
        sweep_local(TINY, ["precision.rollout=bf16,fp4"], run_root=tmp_path / "r")
    assert not (tmp_path / "r").exists()  # nothing started
    with pytest.raises(ValueError, match="expected section.key=v1,v2"):
        sweep_local(TINY, ["mask=ppo"], run_root=tmp_path / "r")
    with pytest.raises(ValueError, match="parallel: 0 must be >= 1"):
        sweep_local(TINY, ["objective.mask=ppo"], run_root=tmp_path / "r", parallel=0)
    assert point_name(("a.b=1", "c.d=x")) == "a.b-1_c.d-x"


@pytest.mark.e2e
def test_cli_refuses_a_bad_grid_in_one_line(tmp_path, capsys):
    """`sweep` with a bad grid value: one line `sweep: <field>: ...`, exit code 2, nothing started (the
    regression: a traceback)."""
    from megatron_pdm.cli import main
    from tests.helpers import one_line

    root = tmp_path / "r"
    assert main(["sweep", "--config", TINY, "--run-root", str(root), "--grid", "objective.mask=ppo,nope"]) == 2
    assert "sweep: objective.mask: 'nope' is not one of" in one_line(capsys, "sweep")
    assert main(["sweep", "--config", str(tmp_path / "none.yaml"), "--grid", "objective.mask=ppo"]) == 2
    assert f"config: {tmp_path / 'none.yaml'} does not exist" in one_line(capsys, "sweep")
    assert not root.exists()
