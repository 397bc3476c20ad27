"""`megatron-pdm submit --dry-run`: the rendered batch scripts parse (`bash -n`) and carry the right srun / torchrun
/ rendezvous / SGLang lines for 1, 2 and 128 nodes; sweeps, containers and bad input."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pdm.plan import plan
from megatron_pdm.submit import Submission, expand_grid, render
from megatron_pdm.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.mark.parametrize("nodes", [1, 2, 128])
def test_torchrun_scripts_for_1_2_128_nodes(nodes, tmp_path):
    # 128 nodes are DP 512: the preset's 256 sequences per minibatch must grow to split over them
    batch = ["train.prompts_per_step=256"] if nodes == 128 else []
    text = _render(PRESETS / "qwen3_8b.yaml", [f"cluster.nodes={nodes}", "cluster.partition=batch", *batch])
    _bash_n(text, tmp_path)
    h = _sbatch(text)
    assert h["nodes"] == str(nodes) and h["ntasks-per-node"] == "1" and h["gpus-per-node"] == "8"
    assert h["signal"] == "B:USR1@90" and "requeue" in h and h["partition"] == "batch"
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
    fraction = plan(cfg).rollout.mem_fraction_static
    assert 0.3 < fraction < 0.85 and f"--mem-fraction-static {fraction:.2f} --enable-memory-saver" in text
    assert '"rollout.release_memory=true")' in text and 'OVERRIDES+=("rollout.urls=[' in text
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in text and "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in text


def test_disaggregated_fp8_engines_spanning_nodes(tmp_path):
    text = _render(PRESETS / "deepseek_v3.yaml", router=True)
    _bash_n(text, tmp_path)
    assert _sbatch(text)["nodes"] == "80" and "TRAIN_NODES=64\n" in text
    assert "ROLLOUT_FIRST=64\nROLLOUT_COUNT=16\n" in text and "ROLLOUT_TP=16" in text
    # FP8: the engines start from a block-FP8 copy made in the job (no --quantization: SGLang then takes the
    # trainer's block-FP8 updates)
    assert '-m megatron_pdm.rollout.fp8_export /checkpoints/DeepSeek-V3-bf16 "$RUN_DIR/weights/fp8-init"' in text
    assert '--model-path "$RUN_DIR/weights/fp8-init" --dtype bfloat16' in text and "--quantization" not in text
    assert "--kv-cache-dtype fp8_e4m3" in text and "--enable-memory-saver" not in text
    assert "release_memory" not in text
    assert "-m sglang_router.launch_router --host 0.0.0.0 --port 29000" in text


def test_srun_launcher_array_and_container(tmp_path):
    grid = expand_grid(["objective.mask=ppo,dppo,pdm", "precision.rollout=bf16,fp8"])
    assert len(grid) == 6 and grid[0] == ("objective.mask=ppo", "precision.rollout=bf16")
    cluster = ["cluster.container_image=nvcr.io/nvidia/pytorch:25.01-py3", "cluster.container_mounts=/data:/data",
               "cluster.env={NCCL_IB_HCA: mlx5}"]
    text = _render(PRESETS / "qwen3_4b.yaml", cluster, launcher="srun", grid=grid, signal_s=300)
    _bash_n(text, tmp_path)
    h = _sbatch(text)
    assert h["array"] == "0-5" and h["ntasks-per-node"] == "8" and h["signal"] == "B:USR1@300"
    assert h["output"].endswith("slurm-%A_%a.out")
    assert "MEGATRON_PDM_SLURM_RANKS=1 srun --nodes=\"$TRAIN_NODES\" --ntasks-per-node=\"$GPUS_PER_NODE\"" in text
    assert "'objective.mask=pdm precision.rollout=fp8'" in text
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3" in text and "--container-mounts=/data:/data" in text
    assert "export NCCL_IB_HCA=mlx5" in text


def test_grid_points_select_run_dirs_in_bash(tmp_path):
    """Run the script's grid prologue for array task 1: the point's overrides and its own run directory."""
    text = _render(PRESETS / "qwen3_4b.yaml", grid=expand_grid(["objective.mask=ppo,pdm"]))
    prologue = text.split("STOP_FILE=")[0].replace("/scratch/runs/x", str(tmp_path))
    out = subprocess.run(["bash", "-c", prologue + '\necho "$RUN_DIR|${OVERRIDES[*]}"'], capture_output=True,
                         text=True, check=True, env={"SLURM_ARRAY_TASK_ID": "1", "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == f"{tmp_path}/objective.mask-pdm|objective.mask=pdm"


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
    with pytest.raises(ValueError, match="cluster.rollout_tp: 3 must divide gpus_per_node 8"):
        _render(PRESETS / "qwen3_4b.yaml", ["cluster.rollout_tp=3"])
    with pytest.raises(ValueError, match="train.init: the rollout engines start from an HF checkpoint"):
        _render(ROOT / "examples" / "tiny_cpu.yaml", ["rollout.engine=sglang"])
    with pytest.raises(ValueError, match="cluster.rollout_nodes: 2 leaves no training node"):
        load_config(PRESETS / "qwen3_4b.yaml", ["cluster.rollout_nodes=2", "cluster.nodes=2"])


def test_cli_dry_run_refuses_what_does_not_fit():
    preset = str(PRESETS / "qwen3_30b_a3b.yaml")
    ok = subprocess.run([sys.executable, "-m", "megatron_pdm.cli", "submit", preset, "--dry-run", "--nodes", "4"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("#!/bin/bash\n#SBATCH")
    no = subprocess.run([sys.executable, "-m", "megatron_pdm.cli", "submit", preset, "--dry-run", "--nodes", "1",
                         "parallel.expert=1"], capture_output=True, text=True)
    assert no.returncode == 1 and "does not fit: needs" in no.stderr and not no.stdout


def test_submit_refuses_what_the_trainer_would_refuse_on_the_cluster():
    """A config without a cluster section is checked at load for a local run; submitting it puts it on the
    (default, 8-GPU) cluster, and every grid point is checked there too, before a job is queued."""
    with pytest.raises(ValueError, match=r"= 3 sequences per minibatch must be divisible by the data-parallel size 4 "
                                         r"= 8 ranks"):
        _render(ROOT / "examples" / "tiny_cpu.yaml", ["train.prompts_per_step=3", "rollout.n=2"])
    with pytest.raises(ValueError, match=r"grid point train.prompts_per_step=33: train.prompts_per_step x rollout.n / "
                                         r"train.minibatches = 33 x 8 / 2 = 132 sequences per minibatch must be "
                                         r"divisible by the data-parallel size 8"):
        _render(PRESETS / "qwen3_4b.yaml", grid=expand_grid(["train.prompts_per_step=64,33"]))


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
    export = text.index("-m megatron_pdm.rollout.fp8_export /checkpoints/Qwen3-30B-A3B-Base "
                        '"$RUN_DIR/weights/fp8-init"')
    assert export < text.index("engines.sh") and "--quantization" not in text
    assert '--model-path "$RUN_DIR/weights/fp8-init" --dtype bfloat16' in text
    cpu = _render(ROOT / "examples" / "tiny_cpu.yaml", ["cluster.gpu=cpu", "rollout.engine=sglang", "train.init=hf",
                                                        "train.init_path=/ckpt", "precision.rollout=fp8"])
    assert 'serve --model-path "$RUN_DIR/weights/fp8-init" --dtype bfloat16' in cpu and "--quantization" not in cpu


def test_the_trainer_learns_the_engine_tp():
    """The trainer sizes the weights group (1 + engine TP x engines) and the per-rank tensor handles from
    rollout.engine_tp: the script sets it to the engines' cluster.rollout_tp."""
    text = _render(PRESETS / "qwen3_8b.yaml", ["cluster.rollout_tp=4"])
    assert '"rollout.engine_tp=4"' in text and "ROLLOUT_TP=4" in text
    cpu = _render(ROOT / "examples" / "tiny_cpu.yaml", ["cluster.gpu=cpu", "rollout.engine=sglang", "train.init=hf",
                                                        "train.init_path=/ckpt", "cluster.rollout_tp=2"])
    assert '"rollout.engine_tp=1"' in cpu  # megatron-pdm serve: one process per engine
