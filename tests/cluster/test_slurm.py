"""`megatron-pdm submit` on a real one-node Slurm cluster (Debian's slurmctld / slurmd / munge, started by
tests/slurm/cluster.sh under a folder of this session and torn down after): the tiny CPU job with 2 ranks under
torchrun, requeue-and-resume on USR1 (what `--signal=B:USR1@90` delivers before the time limit) with metrics
identical to an uninterrupted run, and SGLang-API engines started by the job plus a dependency chain."""

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_pdm.models import canonical_hf_state, save_hf_checkpoint
from megatron_pdm.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
TINY = str(ROOT / "examples" / "tiny_cpu.yaml")
SMALL = ["train.warm_start_steps=5", "train.prompts_per_step=8", "train.eval_prompts=16", "train.eval_every=2"]


def _free_port_pair() -> int:
    """A port p with p + 1 also free (slurmctld, slurmd), so that another cluster on this host is no obstacle."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two adjacent free ports")


@pytest.fixture(scope="module")
def slurm():
    """The cluster's environment (SLURM_CONF); its daemons are this fixture's own and are stopped after."""
    base = f"/tmp/megatron-pdm-test-slurm-{os.getpid()}"  # munge must reach it: not under pytest's 0700 tmp
    env = dict(os.environ, SLURM_BASE=base, SLURM_PORT=str(_free_port_pair()))
    up = subprocess.run(["bash", str(CLUSTER), "up"], env=env, capture_output=True, text=True, timeout=600)
    if up.returncode:
        subprocess.run(["bash", str(CLUSTER), "down"], env=env, capture_output=True)
        pytest.fail(f"slurm cluster did not come up:\n{up.stderr[-3000:]}")
    env["SLURM_CONF"] = up.stdout.strip().splitlines()[-1]
    yield env
    subprocess.run(["bash", str(CLUSTER), "down"], env=env, capture_output=True, timeout=120)


def _job(env, job_id) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True,
                         check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait(env, job_id, *, until=("COMPLETED",), timeout=300) -> dict:
    """Poll until the job is in one of `until`; a requeued job waits ~2 min for its BeginTime, so start it sooner,
    but not at once: started within ~0.1 s of the requeue, slurmd still holds the killed batch step's revoked
    credential and fails the job before its script runs ("Job credential revoked"; seen once in five suites)."""
    end = time.monotonic() + timeout
    requeued_at = None
    while time.monotonic() < end:
        job = _job(env, job_id)
        if job["JobState"] in until:
            return job
        if job["JobState"] in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            raise AssertionError(f"job {job_id} ended {job['JobState']}: {job}\n{_daemon_logs(env, job_id)}")
        if job["JobState"] == "PENDING" and job.get("Reason") == "BeginTime":
            requeued_at = requeued_at or time.monotonic()
            if time.monotonic() - requeued_at >= 5:  # slurmd has dropped the old step by then
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env, check=True)
        time.sleep(0.25)  # a finished job is seen within a quarter second
    raise AssertionError(f"job {job_id} not {until} after {timeout} s: {_job(env, job_id)}")


def _daemon_logs(env, job_id) -> str:
    """The daemons' log lines about the job: what Slurm itself says when a job fails before its script runs."""
    lines = []
    for name in ("slurmctld.log", "slurmd.log"):
        path = Path(env["SLURM_BASE"]) / "log" / name
        if path.is_file():
            lines += [f"{name}: {x}" for x in path.read_text(errors="replace").splitlines()
                      if f"JobId={job_id}" in x or f"job {job_id}" in x.lower() or "error" in x.lower()][-40:]
    return "\n".join(lines)


def _submit(env, run_dir, *args) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "megatron_pdm.cli", "submit", *args, "--gpu", "cpu",
                          "--nodes", "1", "--gpus-per-node", "2", "--time", "00:15:00", "--run-dir", str(run_dir)],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return re.search(r"submitted job ([\d ]+);", out.stdout).group(1).split()


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _log(run_dir):
    return "".join(p.read_text() for p in sorted((Path(run_dir) / "logs").glob("slurm-*.out")))


@pytest.mark.e2e
def test_tiny_job_under_torchrun(slurm, tmp_path):
    run = tmp_path / "run a#b%j"  # a space, # and % reach sbatch's #SBATCH parser and --output's patterns intact
    (job,) = _submit(slurm, run, TINY, *SMALL, "train.steps=4", "train.checkpoint_every=2")
    info = _wait(slurm, job)
    assert info["ExitCode"] == "0:0" and info["NumTasks"] == "1"  # one torchrun on the one node
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(0 <= r["eval/reward"] <= 1 for r in rows if r["step"] % 2 == 0)
    assert all(0 <= r["train/reward"] <= 1 and r["policy/entropy"] > 0 for r in rows[1:])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    assert json.loads((run / "checkpoints" / "step_00000004" / "complete").read_text())["world"] == 2  # 2 ranks
    assert (run / "submit" / "train.sbatch").is_file() and "training exited with 0" in _log(run)


@pytest.mark.e2e
def test_requeue_on_usr1_resumes_and_matches_an_uninterrupted_run(slurm, dist_pools, tmp_path):
    run, steps = tmp_path / "run", ["train.steps=8", "train.checkpoint_every=4"]
    (job,) = _submit(slurm, run, TINY, "--launcher", "srun", *SMALL, *steps)
    end = time.monotonic() + 240
    while not ((run / "metrics.jsonl").is_file() and len(_rows(run)) >= 4):  # step 3 is done: mid-run
        assert time.monotonic() < end, _log(run)
        time.sleep(0.5)
    # what Slurm sends --signal=B:USR1@90 seconds before the time limit: USR1 to the batch shell
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True)
    # the same config trained straight through (the session's two-rank pool, no Slurm), beside the job's stop,
    # its 5 s hold (the cores idle) and its resumed steps (the two share the cores: a longer wait allowed)
    from tests.helpers import rank_train

    straight, pool = tmp_path / "straight", dist_pools(2)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        reference = ex.submit(pool.run, rank_train, shared=(load_config(TINY, [*SMALL, *steps]), str(straight)))
        info = _wait(slurm, job, timeout=600)
        reference.result()
    log = _log(run)
    assert info["Restarts"] == "1" and info["ExitCode"] == "0:0"
    stopped = int(re.search(r"checkpointed after step (\d+); requeueing", log).group(1))
    assert 3 <= stopped < 8 and "(restart 1)" in log
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(9))  # every step once, across the two starts
    for a, b in zip(rows, _rows(straight), strict=True):
        for key in ("train/reward", "train/loss", "eval/reward", "mask/masked_frac", "divergence/mean"):
            assert a.get(key) == pytest.approx(b.get(key), abs=1e-6), (a["step"], key)


@pytest.mark.e2e
def test_sglang_api_engines_started_by_the_job_and_a_chain(slurm, tmp_path):
    """rollout.engine sglang on a CPU cluster: the job starts `megatron-pdm serve` engines (SGLang's HTTP API),
    waits for their health, and trains through them; a chained second job resumes the finished run and adds
    nothing."""
    from tests.helpers import hf_model

    model = load_config(ROOT / "examples" / "tiny_cpu.yaml").model
    from megatron_pdm.train.data import ARITHMETIC_TOKENIZER

    save_hf_checkpoint(tmp_path / "init", canonical_hf_state(hf_model(model, seed=3).state_dict()), model,
                       tokenizer_dir=ARITHMETIC_TOKENIZER)  # an HF checkpoint carries its tokenizer
    run = tmp_path / "run"
    ids = _submit(slurm, run, TINY, "--chain", "2", *SMALL, "train.steps=2",
                  "rollout.engine=sglang", "cluster.rollout_tp=2", "train.init=hf",
                  f"train.init_path={tmp_path / 'init'}")
    assert len(ids) == 2 and _job(slurm, ids[1])["Dependency"].startswith(f"afterany:{ids[0]}")
    _wait(slurm, ids[0])
    _wait(slurm, ids[1])
    log = _log(run)
    assert "health: 1 engine(s) healthy" in log and log.count("training exited with 0") == 2
    assert "serving" in (run / "logs" / "engine-node0-0.log").read_text()
    assert [r["step"] for r in _rows(run)] == [0, 1, 2]
    # the export an engine restart would load; every one it replaced is deleted (one full model a step before)
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["v000002"]


@pytest.mark.e2e
def test_sweep_as_a_job_array(slurm, tmp_path):
    """`megatron-pdm sweep --slurm`: the grid is one job array, one run directory per point, named as a local
    sweep names them."""
    root = tmp_path / "sweep"
    out = subprocess.run([sys.executable, "-m", "megatron_pdm.cli", "sweep", "--slurm", "--config", TINY,
                          "--run-root", str(root), *SMALL, "train.steps=2", "cluster.gpu=cpu", "cluster.nodes=1",
                          "cluster.gpus_per_node=1", "cluster.time='00:15:00'", "parallel.tensor=1",
                          "--grid", "objective.mask=ppo,pdm"],
                         env=slurm, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    job = re.search(r"submitted job (\d+);", out.stdout).group(1)
    end = time.monotonic() + 300
    while subprocess.run(["squeue", "-h", "-j", job], env=slurm, capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < end, _log(root)
        time.sleep(0.25)
    for name in ("objective.mask-ppo", "objective.mask-pdm"):
        assert [r["step"] for r in _rows(root / name)] == [0, 1, 2], _log(root)
    assert _log(root).count("training exited with 0") == 2
