"""`megatron-pdm submit --dry-run`: the rendered batch scripts parse (`bash -n`) and carry the right srun / torchrun
/ rendezvous / SGLang lines for 1, 2 and 128 nodes; sweeps, containers and bad input."""

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pdm.cluster.plan import plan
from megatron_pdm.cluster.submit import Submission, expand_grid, render
from megatron_pdm.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "examples" / "presets"


def _render(config, overrides=(), **sub):
    cfg = load_config(config, list(overrides))
    run_dir = Path("/scratch/runs/x")
    return render(cfg, Submission(run_dir=run_dir, **sub))


def _bash_n(text, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)


def _sbatch(text):
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", text, flags=re.M))


@pytest.mark.e2e
@pytest.mark.parametrize("nodes", [1, 2, 128])
def test_torchrun_scripts_for_1_2_128_nodes(nodes, tmp_path):
    # 128 nodes are DP 512: the preset's 256 sequences per minibatch must grow to split over them
    batch = ["train.prompts_per_step=256"] if nodes == 128 else []
    text = _render(PRESETS / "qwen3_8b.yaml", [f"cluster.nodes={nodes}", "cluster.partition=batch", *batch])
    _bash_n(text, tmp_path)
    h = _sbatch(text)
    assert h["nodes"] == str(nodes) and h["ntasks-per-node"] == "1" and h["gpus-per-node"] == "8"
    assert h["signal"] == "B:USR1@300" and "requeue" in h and h["partition"] == "batch"  # Submission's default
    assert f"TRAIN_NODES={nodes}\n" in text and "GPUS_PER_NODE=8\n" in text
    # one torchrun per node, c10d rendezvous on the first node of the allocation
    assert 'srun --nodes="$TRAIN_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1' in text
    assert '-m torch.distributed.run --nnodes="$TRAIN_NODES" --nproc-per-node="$GPUS_PER_NODE"' in text
    assert '--rdzv-backend=c10d --rdzv-endpoint="$HEAD:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID"' in text
    assert 'HEAD=${NODES[0]}' in text and "--module megatron_pdm.cli train" in text and "--auto-resume" in text
    # colocated SGLang engines of 2 GPUs on every training node, their URLs passed to the trainer
    assert f"ROLLOUT_FIRST=0\nROLLOUT_COUNT={nodes}\n" in text and "ROLLOUT_TP=2" in text
    assert "-m sglang.launch_server --model-path /checkpoints/Qwen3-8B-Base --dtype bfloat16" in text
    # the share of each GPU `plan` leaves beside the trainer's states; released while the trainer trains
    cfg = load_config(PRESETS / "qwen3_8b.yaml", [f"cluster.nodes={nodes}", *batch])
    fraction = plan(cfg, top=0).rollout.mem_fraction_static
    assert 0.3 < fraction < 0.85 and f"--mem-fraction-static {fraction:.2f} --enable-memory-saver" in text
    assert '"rollout.sglang.release_memory=true")' in text and 'OVERRIDES+=("rollout.sglang.urls=[' in text
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in text and "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in text


@pytest.mark.e2e
def test_disaggregated_fp8_engines_spanning_nodes(tmp_path):
    text = _render(PRESETS / "deepseek_v3.yaml", ["cluster.nodes=20", "cluster.rollout_nodes=4"], router=True)
    _bash_n(text, tmp_path)
    assert _sbatch(text)["nodes"] == "20" and "TRAIN_NODES=16\n" in text
    assert "ROLLOUT_FIRST=16\nROLLOUT_COUNT=4\n" in text and "ROLLOUT_TP=16" in text
    # FP8: the engines start from a block-FP8 copy made in the job (no --quantization: SGLang then takes the
    # trainer's block-FP8 updates); the released DeepSeek-V3 checkpoint is block-FP8 already, so it is linked
    assert '-m megatron_pdm.rollout.sglang.fp8_export /checkpoints/DeepSeek-V3 "$RUN_DIR/weights/fp8-init"' in text
    # MLA engines: DP attention and expert parallelism over DeepEP
    assert "--enable-dp-attention --dp-size 8 --ep-size 16 --moe-a2a-backend deepep" in text
    assert '--model-path "$RUN_DIR/weights/fp8-init" --dtype bfloat16' in text and "--quantization" not in text
    assert "--kv-cache-dtype fp8_e4m3" in text and "--enable-memory-saver" not in text
    assert "release_memory" not in text
    assert "-m sglang_router.launch_router --host 0.0.0.0 --port 29000" in text
    assert '> "$RUN_DIR/logs/router$LOG_SUFFIX.log"' in text


@pytest.mark.e2e
def test_srun_launcher_array_and_container(tmp_path):
    grid = expand_grid(["objective.mask=ppo,dppo,pdm", "train.seed=1,2"])
    assert len(grid) == 6 and grid[0] == ("objective.mask=ppo", "train.seed=1")
    cluster = ["cluster.container_image=nvcr.io/nvidia/pytorch:25.01-py3", "cluster.container_mounts=/data:/data",
               "cluster.env={NCCL_IB_HCA: mlx5}"]
    text = _render(PRESETS / "qwen3_4b.yaml", cluster, launcher="srun", grid=grid, signal_s=300)
    _bash_n(text, tmp_path)
    h = _sbatch(text)
    assert h["array"] == "0-5" and h["ntasks-per-node"] == "8" and h["signal"] == "B:USR1@300"
    assert h["output"].endswith("slurm-%A_%a.out")
    assert "MEGATRON_PDM_SLURM_RANKS=1 srun --nodes=\"$TRAIN_NODES\" --ntasks-per-node=\"$GPUS_PER_NODE\"" in text
    assert "'objective.mask=pdm train.seed=2'" in text
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3" in text and "--container-mounts=/data:/data" in text
    assert "export NCCL_IB_HCA=mlx5" in text
    # the health check runs in the container too; the batch shell watches the engines' srun itself
    assert ('srun --overlap --nodes=1 --ntasks=1 --relative=0 "${CONTAINER[@]}" \\\n'
            '  python -m megatron_pdm.rollout.sglang.health --timeout 1800 "${URLS[@]}" &') in _render(
        PRESETS / "qwen3_4b.yaml", cluster)


@pytest.mark.e2e
def test_grid_points_select_run_dirs_in_bash(tmp_path):
    """Run the script's grid prologue for array task 1: the point's overrides and its own run directory."""
    text = _render(PRESETS / "qwen3_4b.yaml", grid=expand_grid(["objective.mask=ppo,pdm"]))
    prologue = text.split("STOP_FILE=")[0].replace("/scratch/runs/x", str(tmp_path))
    out = subprocess.run(["bash", "-c", prologue + '\necho "$RUN_DIR|${OVERRIDES[*]}"'], capture_output=True,
                         text=True, check=True, env={"SLURM_ARRAY_TASK_ID": "1", "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == f"{tmp_path}/objective.mask-pdm|objective.mask=pdm"


@pytest.mark.e2e
def test_embedded_engine_needs_no_servers_and_cpu_requests_no_gpus(tmp_path):
    text = _render(ROOT / "examples" / "tiny_cpu.yaml", ["cluster.gpu=cpu", "cluster.gpus_per_node=2"])
    _bash_n(text, tmp_path)
    h = _sbatch(text)
    assert "gpus-per-node" not in h and "exclusive" not in h and h["cpus-per-task"] == "2"
    assert "no servers to start" in text and "sglang" not in text.replace("# rollout", "")


def test_bad_input_is_named(tmp_path):
    with pytest.raises(ValueError, match="grid 'objective.mask': expected section.key=v1,v2"):
        expand_grid(["objective.mask"])
    with pytest.raises(ValueError, match="launcher: 'mpirun'"):
        _render(PRESETS / "qwen3_4b.yaml", launcher="mpirun")
    with pytest.raises(ValueError, match="cluster.time: 14400: quote it"):
        load_config(PRESETS / "qwen3_4b.yaml", ["cluster.time=4:00:00"])
    with pytest.raises(ValueError, match="cluster.rollout_tp: 3 must divide the 8 rollout GPUs"):
        _render(PRESETS / "qwen3_4b.yaml", ["cluster.rollout_tp=3"])
    with pytest.raises(ValueError, match="train.init: the rollout engines start from an HF checkpoint"):
        _render(ROOT / "examples" / "tiny_cpu.yaml", ["rollout.engine=sglang"])
    with pytest.raises(ValueError, match="cluster.rollout_nodes: 2 leaves no training node"):
        load_config(PRESETS / "qwen3_4b.yaml", ["cluster.rollout_nodes=2", "cluster.nodes=2"])


@pytest.mark.e2e
def test_cli_dry_run_refuses_what_does_not_fit(capsys):
    """(In this process: `cli.main`, what the entry point calls; test_every_submit_error_is_a_message runs the real
    command.)"""
    from megatron_pdm.cli import main

    preset = str(PRESETS / "qwen3_30b_a3b.yaml")
    assert main(["submit", preset, "--dry-run", "--nodes", "4"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash\n#SBATCH")
    assert main(["submit", preset, "--dry-run", "--nodes", "1", "parallel.expert=1"]) == 1
    out = capsys.readouterr()
    assert "does not fit: needs" in out.err and not out.out


def test_submit_refuses_what_the_trainer_would_refuse_on_the_cluster():
    """A config without a cluster section is checked at load for a local run; submitting it puts it on the
    (default, 8-GPU) cluster, and every grid point is checked there too, before a job is queued."""
    with pytest.raises(ValueError, match=r"= 3 sequences per minibatch must be divisible by the data-parallel size 4 "
                                         r"= 8 ranks"):
        _render(ROOT / "examples" / "tiny_cpu.yaml", ["train.prompts_per_step=3", "rollout.n=2"])
    with pytest.raises(ValueError, match=r"grid point train.minibatches=256: train.prompts_per_step x rollout.n / "
                                         r"train.minibatches = 64 x 8 / 256 = 2 sequences per minibatch must be "
                                         r"divisible by the data-parallel size 4"):
        _render(PRESETS / "qwen3_4b.yaml", grid=expand_grid(["train.minibatches=2,256"]))


@pytest.mark.e2e
def test_fp8_engines_start_from_a_block_fp8_copy_sglang_can_load(tmp_path):
    """precision.rollout fp8: the job converts the checkpoint to block-FP8 first and starts the engines from it
    without --quantization (SGLang then takes the trainer's block-FP8 updates); an engine TP whose shards SGLang
    refuses to load as block-FP8 is an error naming the layer, before anything is queued."""
    preset = PRESETS / "qwen3_30b_a3b_fp8_rollout.yaml"
    with pytest.raises(ValueError, match=r"cluster.rollout_tp: 4 with precision.rollout fp8: model.layers.\*.mlp."
                       r"experts.\*.gate_proj/up_proj: .* 768 / engine TP 4 = 192 per shard"):
        _render(preset, ["cluster.rollout_tp=4"])
    text = _render(preset)  # the preset's engine TP 2
    _bash_n(text, tmp_path)
    export = text.index("-m megatron_pdm.rollout.sglang.fp8_export /checkpoints/Qwen3-30B-A3B-Base "
                        '"$RUN_DIR/weights/fp8-init"')
    assert export < text.index("engines.sh") and "--quantization" not in text
    assert '--model-path "$RUN_DIR/weights/fp8-init" --dtype bfloat16' in text
    cpu = _render(ROOT / "examples" / "tiny_cpu.yaml", ["cluster.gpu=cpu", "rollout.engine=sglang", "train.init=hf",
                                                        "train.init_path=/ckpt", "precision.rollout=fp8"])
    assert 'serve --model-path "$RUN_DIR/weights/fp8-init" --dtype bfloat16' in cpu and "--quantization" not in cpu


def test_the_trainer_learns_the_engine_tp():
    """The trainer sizes the weights group (1 + engine TP x engines) and the per-rank tensor handles from
    rollout.sglang.engine_tp: the script sets it to the engines' cluster.rollout_tp."""
    text = _render(PRESETS / "qwen3_8b.yaml", ["cluster.rollout_tp=4"])
    assert '"rollout.sglang.engine_tp=4"' in text and "ROLLOUT_TP=4" in text
    cpu = _render(ROOT / "examples" / "tiny_cpu.yaml", ["cluster.gpu=cpu", "rollout.engine=sglang", "train.init=hf",
                                                        "train.init_path=/ckpt", "cluster.rollout_tp=2"])
    assert '"rollout.sglang.engine_tp=1"' in cpu  # megatron-pdm serve: one process per engine


@pytest.mark.e2e
@pytest.mark.parametrize("preset", sorted(PRESETS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_preset_renders(preset, tmp_path):
    """Every preset passes the trainer's checks on its cluster and renders a script bash accepts, with its colocated
    engines given the positive memory fraction `plan` leaves them; an MoE preset's engines return the routed
    experts its trainer replays under full recompute (R3)."""
    cfg = load_config(preset)
    cfg.check_world_size(cfg.cluster.training_gpus, cfg.cluster.describe_training_gpus())
    text = _render(preset)
    _bash_n(text, tmp_path)
    assert ("--enable-return-routed-experts" in text) == cfg.model.is_moe == cfg.rollout.routed_experts
    if not cfg.cluster.rollout_nodes:
        fraction = plan(cfg, top=0).rollout.mem_fraction_static
        assert 0 < fraction <= 0.85 and f"--mem-fraction-static {fraction:.2f}" in text


def _metrics(run_dir, steps, saves=None):
    """metrics.jsonl with one row per step time; `saves` {row: seconds} adds perf/checkpoint_s to those rows (the
    trainer logs a save's time on the row after it)."""
    saves = saves or {}
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"step": i, "perf/step_s": s, **({"perf/checkpoint_s": saves[i]} if i in saves else {})}
            for i, s in enumerate(steps)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_stop_warning_from_measured_step_time(tmp_path):
    """2 x the mean of the last 20 measured steps plus the checkpoint time, at least 300 s, at most half the time
    limit; a fixed cluster.stop_warning_s wins."""
    from megatron_pdm.cluster.submit import checkpoint_s, measured_step_s, stop_warning_s, time_limit_s

    assert [time_limit_s(t) for t in ("04:00:00", "90", "10:30", "1-02", "2-00:30:00")] == [
        14400, 5400, 630, 93600, 174600]
    cfg = load_config(PRESETS / "deepseek_v3.yaml")
    ckpt = checkpoint_s(cfg)
    assert 100 < ckpt < 3600  # ~0.6 TB per node of weights and Adam states at 1 GiB/s
    assert measured_step_s(tmp_path / "none") is None
    assert stop_warning_s(cfg, tmp_path / "none") == math.ceil(2 * 300 + ckpt)
    _metrics(tmp_path / "run", [5000.0] * 10 + [1500.0] * 20)  # only the last 20 count
    assert measured_step_s(tmp_path / "run") == 1500.0
    assert stop_warning_s(cfg, tmp_path / "run") == math.ceil(3000 + ckpt)
    short = load_config(PRESETS / "deepseek_v3.yaml", ["cluster.time='01:00:00'"])
    assert stop_warning_s(short, tmp_path / "run") == 1800  # half the time limit
    fixed = load_config(PRESETS / "deepseek_v3.yaml", ["cluster.stop_warning_s=120"])
    assert stop_warning_s(fixed, tmp_path / "run") == 120
    grid = tmp_path / "grid"
    _metrics(grid / "objective.mask-ppo", [100.0])
    _metrics(grid / "objective.mask-pdm", [400.0])
    assert measured_step_s(grid) == 400.0  # the slowest point


def test_stop_warning_uses_the_measured_checkpoint_time(tmp_path):
    """Once the trainer has logged perf/checkpoint_s, the lead takes the longest of the last 5 measured saves
    instead of the estimate (for a grid, the slowest point's)."""
    from megatron_pdm.cluster.submit import checkpoint_s, measured_checkpoint_s, stop_warning_s

    cfg = load_config(PRESETS / "deepseek_v3.yaml")
    run = tmp_path / "run"
    _metrics(run, [1500.0] * 20)
    assert measured_checkpoint_s(run) is None
    assert stop_warning_s(cfg, run) == math.ceil(3000 + checkpoint_s(cfg))  # no save measured: the estimate
    _metrics(run, [1500.0] * 20, {1: 900.0, 3: 40.5, 5: 41.0, 7: 42.0, 9: 40.0, 11: 45.2})  # 900 s is not recent
    assert measured_checkpoint_s(run) == 45.2 and checkpoint_s(cfg) > 100
    assert stop_warning_s(cfg, run) == 3046  # 2 x 1,500 + 45.2, rounded up
    _metrics(run, [1500.0] * 20, {4: 0.0})  # a measured save that took no time is a measurement too
    assert measured_checkpoint_s(run) == 0.0 and stop_warning_s(cfg, run) == 3000
    grid = tmp_path / "grid"
    _metrics(grid / "objective.mask-ppo", [100.0], {0: 30.0})
    _metrics(grid / "objective.mask-pdm", [400.0], {0: 70.0})
    assert measured_checkpoint_s(grid) == 70.0


@pytest.mark.e2e
def test_the_jobs_watcher_derives_the_lead_from_the_steps_it_measures(tmp_path):
    """The rendered stop_lead shell function: 2 x the measured mean + the checkpoint time (the longest of the last 5
    measured saves, rounded up; the estimate before the first), at least the submitted lead, at most half the time
    limit."""
    from megatron_pdm.cluster.submit import checkpoint_s

    text = _render(PRESETS / "qwen3_4b.yaml", ["cluster.time='10:00:00'"], signal_s=600)
    func = text[text.index("stop_lead() {"):text.index("stop_watch() {")]
    ckpt = math.ceil(checkpoint_s(load_config(PRESETS / "qwen3_4b.yaml")))
    assert f"if (!n) print {ckpt};" in func and ckpt > 0

    def lead(steps, saves=None):
        _metrics(tmp_path, steps, saves)
        out = subprocess.run(["bash", "-c", f"set -euo pipefail\n{func}\nstop_lead"], capture_output=True, text=True,
                             check=True, env={"RUN_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"})
        return int(out.stdout)

    assert lead([]) == 600 and lead([10.0, 20.0]) == 600
    assert lead([1000.0, 1200.0]) == 2 * 1100 + ckpt
    assert lead([30000.0]) == 18000  # half of the 10 h limit
    assert lead([1000.0, 1200.0], {1: 30.2}) == 2 * 1100 + 31  # a measured save, rounded up
    assert lead([1000.0] * 8, {0: 500.0, 1: 20.0, 2: 20.0, 3: 12.0, 4: 20.0, 6: 21.0}) == 2000 + 21  # the last 5
    assert lead([1000.0], {0: 0.0}) == 2000
    fixed = _render(PRESETS / "qwen3_4b.yaml", ["cluster.stop_warning_s=600"], signal_s=600)
    assert "if [ 1 = 1 ]" in fixed and "if [ 0 = 1 ]" in text


@pytest.mark.e2e
def test_each_requeue_writes_its_own_logs(tmp_path):
    """SLURM_RESTART_COUNT > 0: the batch shell's output goes to slurm-<job>-restart<N>.out and the engines and the
    router log to -restart<N> files; engines.sh starts engines of their own Python without the trainer's
    PYTHONPATH and VIRTUAL_ENV."""
    text = _render(PRESETS / "qwen3_4b.yaml").replace("/scratch/runs/x", str(tmp_path))
    prologue = text[text.index("LOG_DIR="):text.index("export LOG_SUFFIX") + len("export LOG_SUFFIX")]
    (tmp_path / "logs").mkdir()
    for restart in ("0", "2"):
        subprocess.run(["bash", "-c", f"set -euo pipefail\n{prologue}\necho started $RESTART"], check=True,
                       env={"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": restart, "PATH": "/usr/bin:/bin"})
    assert (tmp_path / "logs" / "slurm-7-restart2.out").read_text() == "started 2\n"
    assert not (tmp_path / "logs" / "slurm-7-restart0.out").exists()
    engines = (ROOT / "slurm" / "engines.sh").read_text()
    assert '"$RUN_DIR/logs/engine-node$me-$i${LOG_SUFFIX:-}.log"' in engines
    # engines.sh with a stand-in engine reporting its environment: ENGINE_OWN_ENV=1 (rollout.sglang.engine_python or
    # cluster.engine_image) drops the trainer's PYTHONPATH and VIRTUAL_ENV
    reports = 'echo "${PYTHONPATH-unset} ${VIRTUAL_ENV-unset}"'
    for own, seen in (("1", "unset unset"), ("0", "/trainer /trainer/.venv")):
        subprocess.run(["bash", str(ROOT / "slurm" / "engines.sh"), "bash", "-c", reports], check=True, timeout=30,
                       env={"PATH": "/usr/bin:/bin", "ROLLOUT_NODE_LIST": "n0", "SLURM_NODEID": "0", "ROLLOUT_TP": "1",
                            "GPUS_PER_NODE": "1", "ENGINE_PORT": "1", "RUN_DIR": str(tmp_path), "ENGINE_GPU_ARGS": "0",
                            "ENGINE_OWN_ENV": own, "PYTHONPATH": "/trainer", "VIRTUAL_ENV": "/trainer/.venv"})
        assert (tmp_path / "logs" / "engine-node0-0.log").read_text() == seen + "\n"


@pytest.mark.e2e
def test_cli_signal_fixes_the_stop_warning(capsys):
    from megatron_pdm.cli import main

    assert main(["submit", str(PRESETS / "qwen3_4b.yaml"), "--dry-run", "--signal", "1234"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --signal=B:USR1@1234" in out and "if [ 1 = 1 ]" in out


@pytest.mark.e2e
def test_the_jobs_watcher_touches_the_stop_file_within_the_lead(tmp_path):
    """stop_watch with Slurm's squeue and sleep stood in for: an end time closer than the lead stops the trainer
    (STOP_FILE); an unknown end time leaves the warning to Slurm's USR1."""
    text = _render(PRESETS / "qwen3_4b.yaml", signal_s=600)
    funcs = text[text.index("stop_lead() {"):text.index("stop_watch &")]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sleep").write_text("#!/bin/sh\nexit 0\n")

    def watch(end_expr):
        (bin_dir / "squeue").write_text(f"#!/bin/bash\n{end_expr}\n")
        for f in ("sleep", "squeue"):
            (bin_dir / f).chmod(0o755)
        stop = tmp_path / "STOP"
        stop.unlink(missing_ok=True)
        subprocess.run(["bash", "-c", f"set -euo pipefail\n{funcs}\nstop_watch"], check=True, timeout=30,
                       env={"RUN_DIR": str(tmp_path), "STOP_FILE": str(stop), "SLURM_JOB_ID": "7",
                            "PATH": f"{bin_dir}:/usr/bin:/bin"}, capture_output=True)
        return stop.exists()

    _metrics(tmp_path, [1000.0])  # a lead of 2,000 s and more
    assert watch('date -d "+100 seconds" +%Y-%m-%dT%H:%M:%S')
    assert not watch("echo N/A") and not watch("exit 1")


@pytest.mark.e2e
@pytest.mark.parametrize("args, message", [
    (["missing.yaml"], "submit: config: missing.yaml does not exist"),
    (["{bad}"], "submit: "),
    (["{preset}", "parallel.tensor=3"], "submit: parallel: tensor x pipeline x context = 3 must divide the 8 training"),
    (["{preset}", "--grid", "objective.mask"], "submit: grid 'objective.mask': expected section.key=v1,v2"),
    (["{preset}", "cluster.rollout_tp=3"], "submit: cluster.rollout_tp: 3 must divide the 8 rollout GPUs"),
    (["{preset}", "--grid", "train.minibatches=2,256"], "submit: grid point train.minibatches=256: "),
    (["{tiny}", "rollout.engine=sglang"], "submit: train.init: the rollout engines start from an HF checkpoint"),
    (["{preset}", "--partition", "batch;touch pwned"], "submit: cluster.partition: 'batch;touch pwned' is not a Slurm"),
])
def test_every_submit_error_is_a_message(args, message, tmp_path, monkeypatch, capsys):
    """Bad input, whether the config load, the plan or the script's rendering finds it: one `submit: ...` line
    and exit 2, never a traceback. The command runs in this process (`cli.main`, what the entry point calls; an
    exception would fail the test as a traceback would), but for the first case, which runs the real command."""
    from megatron_pdm.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    values = {"bad": bad, "preset": PRESETS / "qwen3_4b.yaml", "tiny": ROOT / "examples" / "tiny_cpu.yaml"}
    argv = ["submit", "--dry-run", *[a.format(**values) for a in args]]
    if args == ["missing.yaml"]:
        out = subprocess.run([sys.executable, "-m", "megatron_pdm.cli", *argv], capture_output=True, text=True,
                             cwd=tmp_path)
        code, stdout, stderr = out.returncode, out.stdout, out.stderr
    else:
        monkeypatch.chdir(tmp_path)
        code = main(argv)
        stdout, stderr = capsys.readouterr()
    assert code == 2 and message in stderr and "Traceback" not in stderr, stderr
    assert not stdout


@pytest.mark.e2e
def test_a_failing_sbatch_is_a_message(tmp_path):
    """sbatch refusing the job (here a stand-in that fails) is one `submit: sbatch failed ...` line and exit 1."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: x' >&2\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    out = subprocess.run([sys.executable, "-m", "megatron_pdm.cli", "submit", str(PRESETS / "qwen3_4b.yaml"),
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "submit: sbatch failed (1): sbatch: error: invalid partition specified: x" in out.stderr


@pytest.mark.parametrize("override, message", [
    ('cluster.env={"FOO;touch pwned": 1}', "cluster.env: 'FOO;touch pwned' is not a shell identifier"),
    ("cluster.partition=batch; touch pwned", "cluster.partition: 'batch; touch pwned' is not a Slurm partition name"),
    ("cluster.account=a$(touch pwned)", "cluster.account: 'a$(touch pwned)' is not a Slurm account name"),
    ("cluster.time='1;touch pwned-04:00:00'", "cluster.time: '1;touch pwned-04:00:00' is not a Slurm time"),
    # a newline ends an #SBATCH comment line: what follows it would run in the batch shell
    ('cluster.partition="batch\\ntouch pwned"', "cluster.partition: 'batch\\ntouch pwned' is not a Slurm partition"),
    ('cluster.env={NCCL_X: "a\\ntouch pwned"}', "cluster.env.NCCL_X: 'a\\ntouch pwned' is not a one-line string"),
    ('cluster.container_image="img\\ntouch pwned"', "cluster.container_image: 'img\\ntouch pwned' is not a one-line"),
    # the script's own variables and bash's: RUN_DIR after STOP_FILE is set would split the run from its stop file
    ("cluster.env={RUN_DIR: /elsewhere}", "cluster.env: 'RUN_DIR' is the job script's own"),
    ("cluster.env={BASH_ENV: /tmp/x.sh}", "cluster.env: 'BASH_ENV' is the job script's own (or changes how bash"),
    # YAML 1.1 reads an unquoted 0123 as the octal 83: #SBATCH --account=83 was a wrong account (1234 stays 1234)
    ("cluster.account=0123", "cluster.account: 83: quote it (the field is a string, and YAML reads '0123' as the int"),
])
def test_cluster_values_a_shell_would_run_are_refused_at_load(override, message):
    """Every cluster value `submit` writes into the batch script is checked when the config loads, the error naming
    the field and the value; what Slurm sites use passes."""
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(PRESETS / "qwen3_4b.yaml", [override])
    c = load_config(PRESETS / "qwen3_4b.yaml", ["cluster.partition=batch,debug-1", "cluster.account='1234'",
                                                "cluster.time='1-02:00:00'", "cluster.env={_A1: 'x; y'}"]).cluster
    assert (c.partition, c.account, c.time, c.env) == ("batch,debug-1", "1234", "1-02:00:00", {"_A1": "x; y"})
    c = load_config(PRESETS / "qwen3_4b.yaml", ["cluster.account=1234", "cluster.partition=7"]).cluster
    assert (c.account, c.partition) == ("1234", "7")  # a number as written is the name


def test_reserved_env_names_cover_the_job_scripts_variables():
    """Every variable the job scripts assign (slurm/*.sbatch, slurm/*.sh, and what submit renders) is one that
    cluster.env may not set."""
    from megatron_pdm.train.config import SCRIPT_VARIABLES

    texts = [p.read_text() for p in (ROOT / "slurm").iterdir()]
    texts.append((ROOT / "megatron_pdm/cluster/submit.py").read_text())
    assigned = {m for t in texts for m in re.findall(r"^\s*(?:export\s+)?([A-Z_][A-Z0-9_]*)=", t, flags=re.M)}
    assigned |= {m for t in texts for m in re.findall(r"\b(?:for|read -r -a|read -r|read)\s+([A-Z_][A-Z0-9_]*)\b", t)}
    assigned -= {"_"}  # `for _ in`
    assert assigned and assigned <= SCRIPT_VARIABLES, sorted(assigned - SCRIPT_VARIABLES)


def _sbatch_words(text):
    """The words of the #SBATCH lines as sbatch's directive parser reads them (whitespace-separated, double quotes
    and backslash escapes, an unquoted # starts a comment: POSIX shlex with comments reads the words `render` writes
    alike; tests/cluster/test_slurm.py runs a run directory with a space, # and % through a real sbatch)."""
    return [w for line in text.splitlines() if line.startswith("#SBATCH ")
            for w in shlex.split(line[len("#SBATCH "):], comments=True)]


@pytest.mark.e2e
def test_values_that_pass_cannot_run_in_the_script(tmp_path):
    """A run directory and an interpreter path with a space, #, %, quotes and $(...), and an environment value
    `x; touch pwned`: the whole batch script runs (srun, scontrol and squeue stood in for by stubs that record what
    they get), each value arrives as one word, byte for byte, and nothing runs."""
    run_dir = tmp_path / "run a#b%j $(touch pwned) 'q\""
    python = str(tmp_path / "my env $(touch pwned)" / "python")
    cfg = load_config(ROOT / "examples" / "tiny_cpu.yaml", ["cluster.gpu=cpu", "cluster.gpus_per_node=2",
                                                             "cluster.env={NCCL_X: 'x; touch pwned'}"])
    text = render(cfg, Submission(run_dir=run_dir, python=python, sbatch_args=("--comment=a b#c",)))
    _bash_n(text, tmp_path)
    words = _sbatch_words(text)
    assert f"--output={str(run_dir).replace('%', '%%')}/logs/slurm-%j.out" in words  # %% is Slurm's literal %
    assert f"--job-name=mpdm-{run_dir.name}"[:64] in words and "--comment=a b#c" in words
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {"srun": 'printf "%s\\0" "$@" > "$OUT/argv"; printf "%s" "$NCCL_X" > "$OUT/env"',
             "scontrol": "echo node0", "squeue": "exit 1"}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    subprocess.run(["bash", "-c", text], check=True, cwd=tmp_path, capture_output=True, timeout=60,
                   env={"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path), "SLURM_JOB_ID": "7",
                        "SLURM_JOB_NODELIST": "node0"})
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert python in argv and argv[argv.index("--run-dir") + 1] == str(run_dir)
    assert argv[argv.index("--config") + 1] == f"{run_dir}/submit/config.yaml"
    assert (tmp_path / "env").read_text() == "x; touch pwned"
    assert not list(tmp_path.rglob("pwned"))


@pytest.mark.e2e
def test_every_interpreter_and_model_path_is_one_word(tmp_path):
    """The engines, the FP8 export, the router and the health check: the interpreter (here a path holding a space
    and ` MODEL `, the placeholder the engine command was once built around) and the checkpoint stay one word."""
    python = "/opt/my MODEL env/bin/python"
    text = render(load_config(PRESETS / "qwen3_30b_a3b_fp8_rollout.yaml"),
                  Submission(run_dir=Path("/scratch/runs/x"), python=python, router=True))
    _bash_n(text, tmp_path)
    lines = text.splitlines()

    def words(marker):  # the command on the line holding `marker`, as bash splits it
        line = next(x for x in lines if marker in x)
        return shlex.split(line.split(marker, 1)[1] if marker.endswith('"') else line.rstrip(" \\&"))

    engine = words('/engines.sh"')
    assert engine[0] == python and engine[engine.index("--model-path") + 1] == "$RUN_DIR/weights/fp8-init"
    assert words("rollout.sglang.fp8_export")[:4] == [python, "-m", "megatron_pdm.rollout.sglang.fp8_export",
                                               "/checkpoints/Qwen3-30B-A3B-Base"]
    assert words("sglang_router.launch_router")[0] == python
    assert words("megatron_pdm.rollout.sglang.health")[0] == python
    cpu = render(load_config(ROOT / "examples" / "tiny_cpu.yaml", [
        "cluster.gpu=cpu", "rollout.engine=sglang", "train.init=hf", "train.init_path='/ckpt/my model'"]),
        Submission(run_dir=Path("/scratch/runs/x"), python=python))
    engine = shlex.split(next(x for x in cpu.splitlines() if '/engines.sh"' in x).split('/engines.sh"', 1)[1])
    assert engine[:5] == [python, "-m", "megatron_pdm.cli", "serve", "--model-path"] and engine[5] == "/ckpt/my model"


def test_the_engines_own_interpreter_and_image():
    """rollout.sglang.engine_python and cluster.engine_image: the engines' and the router's command lines run that
    interpreter in that image (ENGINE_CONTAINER), without the trainer's PYTHONPATH and VIRTUAL_ENV (ENGINE_OWN_ENV
    for engines.sh), and `plan` names both; without them, nothing is unset."""
    py, image = "/opt/sglang-env/bin/python", "registry.example/sglang:0.5.23"
    cfg = load_config(PRESETS / "qwen3_8b.yaml",
                      [f"rollout.sglang.engine_python={py}", f"cluster.engine_image={image}"])
    text = render(cfg, Submission(run_dir=Path("/scratch/runs/x"), router=True))
    lines = text.splitlines()
    engine = shlex.split(next(x for x in lines if '/engines.sh"' in x).split('/engines.sh"', 1)[1])
    assert engine[:3] == [py, "-m", "sglang.launch_server"]
    router = shlex.split(next(x for x in lines if "sglang_router.launch_router" in x).rstrip(" \\"))
    assert router[:8] == ["env", "-u", "PYTHONPATH", "-u", "VIRTUAL_ENV", py, "-m", "sglang_router.launch_router"]
    assert f"ENGINE_CONTAINER=(--container-image={image} " in text and "ENGINE_OWN_ENV=1" in text
    environment = plan(cfg, top=0).rollout.environment
    assert f"rollout.sglang.engine_python {py}" in environment and f"cluster.engine_image {image}" in environment
    assert "ENGINE_OWN_ENV=0" in _render(PRESETS / "qwen3_8b.yaml")  # engines.sh: test_each_requeue_writes_...


def test_what_a_batch_script_cannot_carry_is_refused(tmp_path):
    """A newline in the run directory, the interpreter, an sbatch option or an engine argument, a backslash in
    --output (Slurm reads it as "no patterns") or an sbatch option that is not one: an error naming it, before any
    script is written."""
    bad = [({"run_dir": Path("/runs/a\ntouch pwned")}, "run_dir: '/runs/a\\ntouch pwned' is not a one-line string"),
           ({"run_dir": Path("/runs/a\\b")}, "run_dir: '/runs/a\\\\b' holds a backslash"),
           ({"python": "/usr/bin/python\ntouch pwned"}, "python: '/usr/bin/python\\ntouch pwned' is not a one-line"),
           ({"sbatch_args": ("--qos=high\ntouch pwned",)}, "sbatch_arg: '--qos=high\\ntouch pwned' is not a one-line"),
           ({"sbatch_args": ("hetjob",)}, "sbatch_arg: 'hetjob' is not an sbatch option")]
    for fields, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            Submission(**{"run_dir": Path("/runs/x"), **fields})
    with pytest.raises(ValueError,
                       match=re.escape("rollout.sglang.server_args: '--x\\ntouch pwned' is not a one-line")):
        _render(ROOT / "examples" / "tiny_cpu.yaml", ["cluster.gpu=cpu", "rollout.engine=sglang", "train.init=hf",
                                                      "train.init_path=/ckpt",
                                                      'rollout.sglang.server_args=["--x\\ntouch pwned"]'])  # YAML's \n


@pytest.mark.parametrize("axis, values", [("precision.rollout", "bf16,fp8"), ("precision.rollout", "bf16,fp16,fp8"),
                                          ("precision.kv_cache", "auto,fp8_e4m3"), ("train.init_path", "/a,/b"),
                                          ("cluster.time", "'01:00:00','02:00:00'"),
                                          ("rollout.sglang.server_args", "[--a],[--b]")])
def test_a_grid_axis_that_changes_the_job_arrays_one_script_is_refused(axis, values):
    """Every array task runs the script rendered once: an axis whose points render the engine block or the #SBATCH
    header differently (the fp16 point would roll out in the first point's bf16) is an error naming the axis and
    its values, before anything is submitted."""
    grid = expand_grid(["objective.mask=ppo,pdm", f"{axis}={values}"])
    with pytest.raises(ValueError, match=re.escape(f"grid {axis}={values}: its values render ") + ".*"
                       + re.escape("submit such points as separate jobs")):
        _render(PRESETS / "qwen3_4b.yaml", grid=grid)


def test_a_grid_over_what_the_trainer_reads_renders():
    grid = expand_grid(["objective.mask=ppo,dppo,pdm", "train.seed=1,2"])
    text = _render(PRESETS / "qwen3_4b.yaml", grid=grid)
    assert _sbatch(text)["array"] == "0-5" and "'objective.mask=dppo train.seed=2'" in text
    # one value for every point: the script is rendered from the points' config (FP8 engines), not the base's
    fp8 = _render(PRESETS / "qwen3_4b.yaml", grid=expand_grid(["objective.mask=ppo,pdm", "precision.rollout=fp8"]))
    assert "-m megatron_pdm.rollout.sglang.fp8_export" in fp8 and "fp8_export" not in text


def test_the_usr1_trap_comes_before_any_srun():
    """A USR1 while the engines start (FP8 export, launch, health wait) must not kill the batch shell."""
    for text in (_render(PRESETS / "qwen3_4b.yaml", ["precision.rollout=fp8"]),
                 _render(ROOT / "examples" / "tiny_cpu.yaml", ["cluster.gpu=cpu", "cluster.gpus_per_node=2"])):
        trap = text.index("trap '")
        first_srun = re.search(r"^[^#\n]*\bsrun ", text, flags=re.M).start()  # a command, not a comment
        assert trap < first_srun and trap < text.index("LOG_DIR=") and "USR1" in text[trap:].split("\n")[0]
        assert text.count("trap '") == 1


@pytest.mark.e2e
@pytest.mark.parametrize("where", ["LOG_DIR=", "# rollout: the embedded engine"])
def test_a_usr1_before_the_trainer_starts_requeues_the_job(where, tmp_path):
    """The batch script with Slurm's commands stood in for and a USR1 to itself before the run directory is known
    or while the engines start: the shell survives, starts no trainer and requeues the job (exit 0)."""
    text = _render(ROOT / "examples" / "tiny_cpu.yaml", ["cluster.gpu=cpu", "cluster.gpus_per_node=2"])
    text = text.replace("/scratch/runs/x", str(tmp_path / "run"))
    text = text.replace(where, "kill -USR1 $$  # Slurm's --signal=B:USR1\n" + where, 1)
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\nif [ "$1" = show ]; then echo n0; else echo "scontrol $*" >> '
                                      f'{calls}; fi\n')
    for name in ("srun", "squeue"):
        (bin_dir / name).write_text(f'#!/bin/bash\necho "{name} $*" >> {calls}\nexit 1\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (tmp_path / "job.sbatch").write_text(text)

    def start():
        return subprocess.run(["bash", str(tmp_path / "job.sbatch")], capture_output=True, text=True, timeout=60,
                              env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n0"})

    out = start()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "USR1: checkpoint and requeue" in out.stdout and "stop requested before training started" in out.stdout
    assert calls.read_text() == "scontrol requeue 7\n"  # no srun: the trainer never started
    assert not (tmp_path / "run" / "STOP_AND_CHECKPOINT").exists()
    # the requeued start stopped before training again: a start-up that does not fit, not requeued forever
    again = start()
    assert again.returncode == 1 and "not requeueing" in again.stderr and "cluster.stop_warning_s" in again.stderr
    assert calls.read_text() == "scontrol requeue 7\n"
