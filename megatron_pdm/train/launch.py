"""Start the training processes: under torchrun / srun (RANK and WORLD_SIZE set) join that world; otherwise spawn
`nproc` local processes over gloo (the CPU path) or NCCL (one per visible GPU)."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Known, harmless noise on a CPU install: megatron without TE / apex, torch's renamed collectives, a GPU-only hint.
_KNOWN_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "is deprecated. Please use `torch.distributed",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "full scope is deprecated",
    "`past_key_values` is deprecated",
)


def quiet_known_warnings() -> None:
    import warnings

    for message in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{re.escape(message)}.*")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _worker(rank: int, world: int, port: int, job, args, threads: int):
    quiet_known_warnings()
    torch.set_num_threads(threads)
    dist.init_process_group(_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _in_world(job, args)
    finally:
        dist.destroy_process_group()


def _in_world(job, args):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    return job(*args)


def train_job(cfg, run_dir, resume, data=None):
    from .trainer import Trainer

    return Trainer(cfg, Path(run_dir), data).run(resume=resume)


def analyze_job(cfg, out_dir, seeds, rollouts, pre_updates):
    from .analyze import format_summary, run_analysis

    result = run_analysis(cfg, out_dir, seeds=seeds, rollouts=rollouts, pre_updates=pre_updates)
    if dist.get_rank() == 0:
        print(format_summary(result["summary"]))
    return result


def default_nproc(cfg) -> int:
    p = cfg.parallel
    return p.tensor * p.pipeline * p.context * p.expert


def _ranks_from_slurm() -> None:
    """Under `srun` with one task per rank (the batch script sets MEGATRON_PDM_SLURM_RANKS=1 and MASTER_ADDR /
    MASTER_PORT), torch's RANK / WORLD_SIZE / LOCAL_RANK are Slurm's PROCID / NTASKS / LOCALID."""
    if os.environ.get("MEGATRON_PDM_SLURM_RANKS") != "1" or "RANK" in os.environ:
        return
    for torch_name, slurm_name in (("RANK", "SLURM_PROCID"), ("WORLD_SIZE", "SLURM_NTASKS"),
                                   ("LOCAL_RANK", "SLURM_LOCALID")):
        if slurm_name not in os.environ:
            raise RuntimeError(f"MEGATRON_PDM_SLURM_RANKS=1 but {slurm_name} is not set (not inside srun?)")
        os.environ[torch_name] = os.environ[slurm_name]


def launch(job, args: tuple, cfg, *, nproc: int | None = None):
    """Run job(*args) on every rank: in the torchrun / srun world if there is one, else in `nproc` spawned
    processes (default TP x PP x EP of cfg)."""
    quiet_known_warnings()
    _ranks_from_slurm()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(_backend())
        try:
            return _in_world(job, args)
        finally:
            dist.destroy_process_group()
    nproc = nproc or default_nproc(cfg)
    threads = max(1, (os.cpu_count() or 1) // nproc)
    mp.start_processes(_worker, args=(nproc, _free_port(), job, args, threads), nprocs=nproc,
                       start_method="spawn", join=True)
