"""Distributed checkpoints: resume equality for every optimizer setting the presets use, resharding across TP,
DP and EP, export to HF, and bad input (another model, a truncated checkpoint, no checkpoint)."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_pdm.cli import main
from megatron_pdm.train.checkpoint import checkpoint_problem, complete_checkpoints
from megatron_pdm.train.config import config_from_dict, load_config
from tests.helpers import TRAIN_DENSE, TRAIN_MOE, _with, compare_rows, init_checkpoint, rank_train, train_cfg

ROOT = Path(__file__).resolve().parents[2]


def _exact(a_rows, b_rows, a_state, b_state):
    """Resumed at the same layout, nothing is recomputed in another order: metrics to 1e-6 and weights to 1e-6
    (fp32 round-off of the identical computation; in practice bitwise)."""
    assert [r["step"] for r in a_rows] == [r["step"] for r in b_rows]
    for x, y in zip(a_rows, b_rows, strict=True):
        for k in x.keys() & y.keys():
            if not k.startswith("perf/") and isinstance(x[k], float):
                assert x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-6), (x["step"], k)
    for k in b_state:
        torch.testing.assert_close(a_state[k].float(), b_state[k].float(), atol=1e-6, rtol=1e-6)


SETTINGS = {
    "distributed-optimizer": (dict(optim={"distributed_optimizer": True}), {}),
    "bf16": (dict(optim={"distributed_optimizer": True}, precision={"train": "bf16"}), {}),
    "fp16-dynamic-scale": (dict(optim={"distributed_optimizer": True}, precision={"train": "fp16"}), {}),
    "async-save": (dict(optim={"distributed_optimizer": True}, train={"async_save": True}), {}),
}


@pytest.mark.parametrize("setting", SETTINGS, ids=list(SETTINGS))
def test_resume_equals_the_straight_run(dist_pools, tmp_path, setting):
    """N straight steps equal N/2 steps, a resume, and N/2 steps (DP 2: the distributed optimizer shards its
    state; the regression: megatron's optimizer.state_dict() holds no Adam moments under it, and a resumed run
    diverged to NaN)."""
    sections, _ = SETTINGS[setting]
    init = init_checkpoint(tmp_path, TRAIN_DENSE, dist_pools)
    full = _with(train_cfg(TRAIN_DENSE, {}, init, steps=4, checkpoint_every=2, keep_last=2), **sections)
    half = _with(train_cfg(TRAIN_DENSE, {}, init, steps=2, checkpoint_every=2, keep_last=2), **sections)
    straight, s_state = dist_pools(2).run(rank_train, shared=(full, str(tmp_path / "straight")))[0]
    dist_pools(2).run(rank_train, shared=(half, str(tmp_path / "resumed")))
    resumed, r_state = dist_pools(2).run(rank_train, shared=(full, str(tmp_path / "resumed"), True))[0]
    _exact(resumed, straight, r_state, s_state)
    assert all(r.get("train/loss", 0) == r.get("train/loss", 0) for r in resumed)  # no NaN
    # per-rank rollout data: rank 1 received its DP share as tensors (rank 0 holds the samples)
    assert all(r["perf/rollout_bytes_per_rank"] > 0 for r in resumed if "train/loss" in r)
    if setting == "fp16-dynamic-scale":
        assert resumed[-1]["train/loss_scale"] == straight[-1]["train/loss_scale"]


RESHARD = {
    # name: (model, written at (parallel, world), resumed at (parallel, world), optimizer)
    "tp2-to-tp1": (TRAIN_DENSE, ({"tensor": 2}, 2), ({}, 1), {"distributed_optimizer": True}),
    "dp1-to-dp2": (TRAIN_DENSE, ({}, 1), ({}, 2), {"distributed_optimizer": True}),
    "moe-tp2-to-tp1": (TRAIN_MOE, ({"tensor": 2}, 2), ({}, 1), {"distributed_optimizer": True}),
    # megatron chains a separate expert optimizer only when EP > 1: the chain changes length here
    "moe-ep2-to-ep1": (TRAIN_MOE, ({"expert": 2}, 2), ({}, 1), {"distributed_optimizer": True}),
    # the distributed optimizer shards over DP x CP: context-parallel ranks become data-parallel ones
    "cp2-to-dp2": (TRAIN_DENSE, ({"context": 2}, 2), ({}, 2), {"distributed_optimizer": True}),
    # virtual pipeline stages: one state key per model chunk ("model0", "model1"), tensors keyed by global layer
    "pp3-vp2-to-pp1": ({**TRAIN_DENSE, "num_layers": 6}, ({"pipeline": 3, "virtual": 2}, 3), ({}, 1),
                       {"distributed_optimizer": True}),
    "pp1-to-pp3-vp2": ({**TRAIN_DENSE, "num_layers": 6}, ({}, 1), ({"pipeline": 3, "virtual": 2}, 3),
                       {"distributed_optimizer": True}),
}


def _train_resumed(group, cfg, run_dir):
    """rank_train resumed, which also returns the weights as the checkpoint loaded them (before any step)."""
    from megatron_pdm.models import hf_state_from_model
    from megatron_pdm.train.trainer import Trainer

    trainer, loaded = Trainer(cfg, Path(run_dir)), {}
    resume = trainer.resume

    def resume_and_record():
        step = resume()
        loaded.update(hf_state_from_model(trainer.chunks, cfg.model, trainer.parallel))  # every rank: collective
        return step

    trainer.resume = resume_and_record
    rows = trainer.run(resume=True)
    state = hf_state_from_model(trainer.chunks, cfg.model, trainer.parallel)
    trainer.parallel.close()
    return rows, state, loaded


@pytest.mark.parametrize("case", RESHARD, ids=list(RESHARD))
def test_resume_at_another_layout(dist_pools, tmp_path, case):
    """A checkpoint written at one layout continues at another: the weights after load are the writer's exactly,
    and the next step (rollouts from those weights, then an update that needs the Adam moments and step count)
    equals the writer's own next step within fp32 summation-order tolerance (TP / DP / EP change the order of
    the sums in the forward and backward passes and the gradient reductions: rel 1e-4, as across layouts)."""
    model, (wrote, w_world), (reads, r_world), optim = RESHARD[case]
    init = init_checkpoint(tmp_path, model, dist_pools)
    cfg = lambda parallel, steps: _with(train_cfg(model, parallel, init, steps=steps, checkpoint_every=2),  # noqa: E731
                                        optim=optim)
    straight, s_state = dist_pools(w_world).run(rank_train, shared=(cfg(wrote, 3), str(tmp_path / "straight")))[0]
    _, at_two = dist_pools(w_world).run(rank_train, shared=(cfg(wrote, 2), str(tmp_path / "run")))[0]
    resumed, r_state, loaded = dist_pools(r_world).run(_train_resumed, shared=(cfg(reads, 3), str(tmp_path / "run")))[0]
    for k in at_two:
        torch.testing.assert_close(loaded[k], at_two[k], atol=0, rtol=0)
    compare_rows(resumed, straight, sampled_after_update=False)
    for k in s_state:  # one update after the resume: fp32 order only (a lost Adam state moves weights ~lr)
        torch.testing.assert_close(r_state[k], s_state[k], atol=2e-5, rtol=1e-4)


def test_bad_checkpoints(dist_pools, tmp_path):
    init = init_checkpoint(tmp_path, TRAIN_DENSE, dist_pools)
    cfg = train_cfg(TRAIN_DENSE, {}, init, steps=2, checkpoint_every=1, keep_last=2)
    dist_pools(1).run(rank_train, shared=(cfg, str(tmp_path / "run")))
    ckpts = tmp_path / "run" / "checkpoints"
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step_00000001", "step_00000002"]
    # a truncated shard: skipped, with the reason, and the previous checkpoint resumes
    shard = next((ckpts / "step_00000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])
    assert "truncated" in checkpoint_problem(ckpts / "step_00000002")
    rows, _ = dist_pools(1).run(rank_train, shared=(cfg, str(tmp_path / "run"), True))[0]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # a corrupt file of the right size: the load fails, the checkpoint is set aside and the previous one resumes
    meta = ckpts / "step_00000002" / ".metadata"
    meta.write_bytes(bytes(meta.stat().st_size))
    assert checkpoint_problem(ckpts / "step_00000002") is None  # the manifest cannot tell
    three = _with(cfg, train={"steps": 3})
    rows, _ = dist_pools(1).run(rank_train, shared=(three, str(tmp_path / "run"), True))[0]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and (ckpts / "step_00000002.failed").is_dir()
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step_00000002", "step_00000003"]
    # another model: the first mismatched tensor and both shapes
    d = cfg.to_dict()
    wider = config_from_dict({**d, "model": {**d["model"], "ffn_hidden_size": 96},
                              "train": {**d["train"], "init": "random", "init_path": None, "steps": 3}})
    with pytest.raises(RuntimeError, match=r"a checkpoint of another model: decoder.layers.mlp.linear_fc2.weight: the "
                                           r"checkpoint has shape \(2, 32, 64\), this model \(2, 32, 96\)"):
        dist_pools(1).run(rank_train, shared=(wider, str(tmp_path / "run"), True))
    # --resume with no checkpoint names the directory
    with pytest.raises(RuntimeError, match=f"no complete checkpoint under {tmp_path / 'empty' / 'checkpoints'}"):
        dist_pools(1).run(rank_train, shared=(cfg, str(tmp_path / "empty"), True))


def rank_train_with_fault(group, fault, cfg, run_dir, resume):
    """rank_train with MEGATRON_PDM_FAIL_AT set on every rank (the rank it names raises there)."""
    os.environ["MEGATRON_PDM_FAIL_AT"] = fault
    try:
        return rank_train(group, cfg, run_dir, resume)
    finally:
        del os.environ["MEGATRON_PDM_FAIL_AT"]


class _Pwn:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_load_failures_of_the_process_never_set_checkpoints_aside(dist_pools, tmp_path):
    """Regressions, at DP 2: (1) an out-of-memory error on one rank while loading set every checkpoint aside, one
    after the other, and the next --auto-resume silently started from step 0: now it is an error on every rank and
    nothing is set aside; (2) resuming unpickled a checkpoint's RNG files with weights_only=False, running code put
    there: now the file is refused (the checkpoint is corrupt: set aside, the previous one loads) and nothing runs;
    (3) at most one checkpoint is set aside per attempt, and (4) a run whose checkpoints were all set aside is an
    error for --auto-resume, never a fresh start."""
    init = init_checkpoint(tmp_path, TRAIN_DENSE, dist_pools)
    cfg = train_cfg(TRAIN_DENSE, {}, init, steps=2, checkpoint_every=1, keep_last=3, eval_every=2)
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    dist_pools(2).run(rank_train, shared=(cfg, str(run)))
    names = lambda: [p.name for p in sorted(ckpts.iterdir())]  # noqa: E731
    assert names() == ["step_00000001", "step_00000002"]
    with pytest.raises(RuntimeError, match=r"step_00000002: failed to load \(OutOfMemoryError: injected at "
                                           r"checkpoint_load 2 on rank 1 .*not a corrupt file that we can tell: "
                                           r"nothing set aside"):
        dist_pools(2).run(rank_train_with_fault, shared=("checkpoint_load:2:1", cfg, str(run), "auto"))
    assert names() == ["step_00000001", "step_00000002"]
    # a pickled object in step 2's RNG file: refused, step 2 set aside, step 1 resumes (and step 2 is trained again)
    marker = tmp_path / "pwned"
    torch.save({"torch": _Pwn(marker)}, ckpts / "step_00000002" / "rng" / "rank_00001.pt")
    size = (ckpts / "step_00000002" / "rng" / "rank_00001.pt").stat().st_size
    manifest = json.loads((ckpts / "step_00000002" / "complete").read_text())
    manifest["files"]["rng/rank_00001.pt"] = size  # the manifest agrees: only a load can tell
    (ckpts / "step_00000002" / "complete").write_text(json.dumps(manifest))
    rows, _ = dist_pools(2).run(rank_train, shared=(cfg, str(run), "auto"))[0]
    assert not marker.exists() and [r["step"] for r in rows] == [0, 1, 2]
    assert names() == ["step_00000001", "step_00000002", "step_00000002.failed"]
    # both left corrupt: the newest is set aside, the next failure is an error, not a second rename
    for step in ("step_00000001", "step_00000002"):
        meta = ckpts / step / ".metadata"
        meta.write_bytes(bytes(meta.stat().st_size))
    with pytest.raises(RuntimeError, match="two in a row look like a failure of this process; nothing more set aside"):
        dist_pools(2).run(rank_train, shared=(cfg, str(run), "auto"))
    assert names() == ["step_00000001", "step_00000002.1.failed", "step_00000002.failed"]
    # every checkpoint set aside: --auto-resume refuses instead of starting over
    (ckpts / "step_00000001").rename(ckpts / "step_00000001.failed")
    with pytest.raises(RuntimeError, match=r"no checkpoint to resume, and 3 set aside after failing to load"):
        dist_pools(2).run(rank_train, shared=(cfg, str(run), "auto"))


def test_checkpoint_metadata_never_runs_code(tmp_path):
    """Regression: torch.distributed.checkpoint unpickles `.metadata` with a plain pickle.load (and megatron's byte
    items with weights_only=False): a global it names ran before any check. `check_pickles` reads it first, admitting
    only what dist_checkpointing writes: a crafted file is refused (an UnpicklingError: a corrupt checkpoint) and
    nothing runs; `export` refuses it in one line."""
    import pickle

    from megatron_pdm.train.checkpoint import check_pickles, failure_kind

    marker = tmp_path / "pwned"
    (tmp_path / "step_00000001").mkdir()
    (tmp_path / "step_00000001" / ".metadata").write_bytes(pickle.dumps(_Pwn(marker)))
    with pytest.raises(pickle.UnpicklingError, match=r"global posix.system is not what dist_checkpointing writes") \
            as refused:
        check_pickles(tmp_path / "step_00000001")
    assert not marker.exists() and failure_kind(refused.value) == 1  # CORRUPT: set aside, never loaded


def test_export_config_never_imports_the_runs_tools(tmp_path):
    """`run_config` loads a checkpoint's config without its user code: rollout.tool_fn / generate_fn (which loading
    would import, and run) are dropped with data.reward, and max_turns is 1 (more turns need a tool). The
    regression: a multi-turn run's checkpoint exported from another directory failed (FileNotFoundError), and a
    tool module present ran at export."""
    import yaml

    from megatron_pdm.train.checkpoint import CONFIG_FILE
    from megatron_pdm.train.export import run_config

    marker = tmp_path / "imported"
    tool = tmp_path / "tools.py"
    tool.write_text(f"open({str(marker)!r}, 'w').close()\ndef f(*args):\n    return None\n")
    d = load_config(None).to_dict()
    for rollout in ({"tool_fn": "missing.py:f", "max_turns": 2}, {"tool_fn": f"{tool}:f", "max_turns": 3},
                    {"generate_fn": f"{tool}:f", "max_turns": 2}):
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir(exist_ok=True)
        (ckpt / CONFIG_FILE).write_text(yaml.safe_dump({**d, "rollout": {**d["rollout"], **rollout}}))
        cfg = run_config(ckpt)
        assert (cfg.rollout.tool_fn, cfg.rollout.generate_fn, cfg.rollout.max_turns) == (None, None, 1)
        assert cfg.model == load_config(None).model
    assert not marker.exists()


@pytest.mark.e2e
def test_export_loads_in_transformers(dist_pools, tmp_path, capsys):
    """`megatron-pdm export` from one process, whatever wrote the checkpoint (here TP 2): safetensors shards, the
    index, config.json and the tokenizer; transformers loads it, with the trainer's weights. The run's reward
    module is gone by then (the regression: the export imported it, loading the run's config)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    init = init_checkpoint(tmp_path, TRAIN_DENSE, dist_pools)
    reward = tmp_path / "my_reward.py"  # the run's own reward module, which the export's machine need not have
    reward.write_text("def score(response, answer, metadata):\n    return float(response.strip() == answer)\n")
    cfg = _with(train_cfg(TRAIN_DENSE, {"tensor": 2}, init, steps=1), data={"reward": f"{reward}:score"})
    _, state = dist_pools(2).run(rank_train, shared=(cfg, str(tmp_path / "run")))[0]
    reward.unlink()
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    out = tmp_path / "run" / "hf"  # a new directory beside the checkpoints is fine
    cli = [sys.executable, "-m", "megatron_pdm.cli", "export", str(ckpt), "--to", str(out)]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    AutoTokenizer.from_pretrained(out)
    theirs = model.state_dict()
    for k, v in state.items():
        torch.testing.assert_close(theirs[k], v, atol=0, rtol=0)
        assert k in index["weight_map"]
    assert main(["export", str(ckpt), "--to", str(out)]) == 2  # refused before any process starts: in this one
    refusal = capsys.readouterr().err
    assert "exists" in refusal and "--force" in refusal
    assert subprocess.run(cli + ["--force"], capture_output=True, text=True, timeout=300, cwd=ROOT).returncode == 0


@pytest.mark.e2e
def test_export_refuses_to_write_over_its_run(tmp_path, capsys):
    """--to (even with --force, which deletes it first) may not be the run directory, contain it, or lie in its
    checkpoints directory, symlinks resolved: one line naming both, and the run as it was (the regression: the
    run's checkpoints were deleted). The checkpoint's config names a reward module that does not exist here:
    the export loads it without the reward."""
    from megatron_pdm.cli import main
    from megatron_pdm.train.export import check_export
    from tests.helpers import one_line, published_checkpoint

    d = load_config(ROOT / "examples" / "tiny_cpu.yaml").to_dict()
    d["data"]["reward"] = "no_such_reward_package.rewards:score"
    run = tmp_path / "runs" / "x"
    ckpt = published_checkpoint(run, d)
    (tmp_path / "link").symlink_to(run, target_is_directory=True)
    files = lambda: {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}  # noqa: E731
    before = files()
    for out, why in ((run, f"is the run directory {run}"), (tmp_path / "runs", f"contains the run directory {run}"),
                     (tmp_path / "link", f"is the run directory {run}"),
                     (run / "checkpoints", f"is inside the checkpoints directory {run / 'checkpoints'}"),
                     (ckpt, "is inside the checkpoints directory"),
                     (run / "checkpoints" / "hf", "is inside the checkpoints directory")):
        pattern = re.escape(f"--to {out}: {why}") + ".* " + re.escape(f"the checkpoint {ckpt};")
        with pytest.raises(ValueError, match=pattern):
            check_export(ckpt, out, force=True)
    assert main(["export", str(ckpt), "--to", str(run), "--force"]) == 2
    assert f"export: --to {run}: is the run directory {run} of the checkpoint {ckpt}" in one_line(capsys, "export")
    assert files() == before
    for out in (run / "hf", tmp_path / "hf"):  # beside the checkpoints, or anywhere else
        cfg = check_export(ckpt, out, force=True)
        assert cfg.data.reward == "exact_number" and cfg.objective.mask == d["objective"]["mask"]


# each fault point once; every kill after the first hits a run resumed from the previous kill's leftovers (the
# checkpoint write leaves a step_N.tmp that the next start must ignore)
KILLS = ("step:2", "checkpoint_write:3", "weight_sync:4")


def _train_as_launched(group, cfg, run_dir):
    """rank_train with the thread count `megatron-pdm train` gives each of its ranks (`launch`: the cores over the
    ranks; a different count would change the CPU sums' order on a larger machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.size()))
    try:
        return rank_train(group, cfg, run_dir)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.e2e
def test_sigkill_at_three_moments_then_resume(dist_pools, tmp_path):
    """The tiny job killed with SIGKILL (its whole process group) inside a step (after the rollout), during a
    checkpoint write (shards on disk, not yet published) and during a weight sync (the engine updated, the step
    not yet logged). Resumed with --resume each time, it ends with the uninterrupted run's metrics, and no kill
    ever leaves a half-published checkpoint."""
    overrides = ["train.steps=4", "train.checkpoint_every=1", "train.keep_last=2", "train.eval_every=4",
                 "train.prompts_per_step=4", "rollout.n=4", "train.eval_prompts=8", "train.warm_start_steps=1",
                 "parallel.tensor=1", "optim.distributed_optimizer=true"]
    base = [sys.executable, "-m", "megatron_pdm.cli", "train", "--config", str(ROOT / "examples/tiny_cpu.yaml"),
            "--nproc", "2", *overrides]

    def train(run_dir, *extra, kill_at=None):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if kill_at:
            env["MEGATRON_PDM_KILL_AT"] = kill_at
        return subprocess.run([*base, "--run-dir", str(run_dir), *extra], capture_output=True, text=True,
                              timeout=600, cwd=ROOT, env=env, start_new_session=True)

    # the uninterrupted run in the session's two-rank pool (the CLI's start-up, 9 s, is what the killed runs test)
    dist_pools(2).run(_train_as_launched, shared=(load_config(ROOT / "examples/tiny_cpu.yaml", overrides),
                                                  str(tmp_path / "straight")))
    run = tmp_path / "killed"
    for i, moment in enumerate(KILLS):
        done = train(run, *(["--resume"] if i else []), kill_at=moment)
        assert done.returncode == -signal.SIGKILL, (moment, done.returncode, done.stderr[-3000:])
        for p in (run / "checkpoints").iterdir():  # published means complete; the rest is a .tmp
            assert p.suffix == ".tmp" or checkpoint_problem(p) is None, (moment, p)
        assert complete_checkpoints(run / "checkpoints"), moment  # something to resume from, always
    final = train(run, "--resume")
    assert final.returncode == 0, final.stderr[-3000:]
    rows = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    a, b = rows(run), rows(tmp_path / "straight")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(5))
    for x, y in zip(a, b, strict=True):
        for k in y:
            if not k.startswith("perf/") and isinstance(y[k], float):
                assert x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-6), (x["step"], k)


def test_trainer_state_of_an_older_version_compares_equal_at_the_same_layout(tmp_path):
    """A checkpoint written before `parallel.virtual` existed has no such key: read back, its layout takes the
    default, so a resume at the same layout restores every rank's RNG state (the regression: it compared unequal
    and the resume was called a reshard)."""
    from dataclasses import asdict

    from megatron_pdm.models import ParallelConfig
    from megatron_pdm.train.checkpoint import TRAINER_STATE, read_trainer_state

    old = {"tensor": 2, "pipeline": 1, "expert": 1, "context": 1, "expert_tensor": 0, "first_stage_layers": 0,
           "last_stage_layers": 0}
    (tmp_path / TRAINER_STATE).write_text(json.dumps({"step": 4, "parallel": old}))
    assert read_trainer_state(tmp_path)["parallel"] == asdict(ParallelConfig(tensor=2))
