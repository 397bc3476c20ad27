"""tests/gpu/run_all.sh on a CPU: the script parses, skips every GPU check with its reason and writes the summary;
the summary's key numbers and verdicts from checks' outputs as a GPU run leaves them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.summarize import main as summarize_main

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "run_all.sh"
CHECKS = ["train_tp1", "train_tp2", "policy_loss", "kernels", "te_spec", "moe", "train_offload", "train_cp2",
          "train_dsv3", "sglang"]


@pytest.mark.e2e
def test_script_skips_every_gpu_check_and_writes_the_summary(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    out = subprocess.run(["bash", str(SCRIPT), "--no-gpu", "--out", str(tmp_path)], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [c["name"] for c in summary["checks"]] == CHECKS
    assert all(c["status"] == "skipped (no CUDA)" for c in summary["checks"])
    assert summary["ran"] == 0 and summary["failed"] == [] and summary["environment"]["cuda"] is False
    assert "0 of 10 checks ran, 0 failed" in out.stdout and "train_tp1      skipped (no CUDA)" in out.stdout
    bad = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": "/bin/false"}, timeout=60)
    assert bad.returncode == 2 and "install the repository first" in bad.stdout


def _step(out, name, kind, status, rc=0):
    return {"name": name, "kind": kind, "status": status, "seconds": 12.5, "rc": rc,
            "log": str(out / "logs" / f"{name}.log")}


def test_summary_reads_each_checks_numbers_and_fails_on_problems(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    run = tmp_path / "runs" / "train_tp1"
    run.mkdir(parents=True)
    rows = [{"step": 0, "eval/reward": 0.1}] + [{"step": s, "train/loss": 0.5, "train/grad_norm": 0.3 * s}
                                                 for s in (1, 2, 3)]
    run.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad_run = tmp_path / "runs" / "train_tp2"
    bad_run.mkdir()
    bad_run.joinpath("metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": float("nan")}) + "\n")
    (tmp_path / "policy_loss_gpu.json").write_text(json.dumps({
        "a": {"mask_flips": 0, "grad_rel_err": 1e-3, "loss_rel_err": 1e-6},
        "b": {"mask_flips": 1, "grad_rel_err": 2e-3}}))
    (tmp_path / "logs" / "policy_loss.log").write_text("13 passed in 20.1s\n")
    (tmp_path / "logs" / "te_spec.log").write_text("2 skipped in 1.0s\n")
    steps = [_step(tmp_path, "train_tp1", "train", "passed"), _step(tmp_path, "train_tp2", "train", "passed"),
             _step(tmp_path, "policy_loss", "policy_loss", "passed"),
             _step(tmp_path, "kernels", "kernels", "timeout (120 s)", rc=124),
             _step(tmp_path, "te_spec", "pytest", "passed"),
             {**_step(tmp_path, "sglang", "sglang", "skipped (import sglang fails)"), "seconds": 0, "rc": None}]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    code = summarize_main(["--steps", str(tmp_path / "steps.jsonl"), "--out", str(tmp_path / "summary.json")])
    assert code == 1
    checks = {c["name"]: c for c in json.loads((tmp_path / "summary.json").read_text())["checks"]}
    assert checks["train_tp1"]["status"] == "passed" and checks["train_tp1"]["numbers"]["steps"] == [0, 1, 2, 3]
    assert checks["train_tp2"]["status"].startswith("failed (the run logged steps [1]")
    pl = checks["policy_loss"]["numbers"]
    assert pl["cases"] == 2 and pl["mask_flips"] == 1 and pl["max_grad_rel_err"] == 2e-3 and pl["passed"] == 13
    assert checks["kernels"]["status"] == "timeout (120 s)"
    assert checks["te_spec"]["status"] == "skipped (pytest skipped every test)"
    assert checks["sglang"]["numbers"] == {}
    printed = capsys.readouterr().out
    assert "4 of 6 checks ran, 2 failed: train_tp2, kernels" in printed
