"""Checkpoints that are never lost: each is written under a temporary name by every rank and published by one
rename once all ranks are done; the older ones are pruned only after the new one is complete."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_pdm.compat import cuda_to_cpu_scope

COMPLETE = "complete"
# A job script touches STOP_FILE in the run directory when Slurm signals that the time limit is near; the trainer
# then checkpoints after its current step, writes REQUEUE_FILE and returns, and the script requeues the job.
STOP_FILE = "STOP_AND_CHECKPOINT"
REQUEUE_FILE = "REQUEUE"


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def complete_checkpoints(root) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step_") and (p / COMPLETE).is_file())


def latest_checkpoint(root) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1] if done else None


def save_checkpoint(root, step: int, model, optimizer, *, rank: int, keep_last: int) -> Path:
    """Every rank writes its shard into step_N.tmp/; rank 0 then marks it complete and renames it to step_N."""
    root = Path(root)
    final, tmp = _step_dir(root, step), _step_dir(root, step).with_suffix(".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    with cuda_to_cpu_scope():
        state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    part = tmp / f"rank_{rank:05d}.pt"
    torch.save(state, part.with_suffix(".pt.partial"))
    part.with_suffix(".pt.partial").replace(part)
    dist.barrier()
    if rank == 0:
        (tmp / COMPLETE).write_text(f"{dist.get_world_size()}\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.replace(final)
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old)
    dist.barrier()
    return final


def load_checkpoint(path, model, optimizer, *, rank: int) -> int:
    """Restore this rank's model and optimizer shard; returns the step the checkpoint was taken after."""
    path = Path(path)
    world = int((path / COMPLETE).read_text())
    if world != dist.get_world_size():
        raise ValueError(f"{path}: written by {world} ranks, this run has {dist.get_world_size()}")
    state = torch.load(path / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    with cuda_to_cpu_scope():
        optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])
