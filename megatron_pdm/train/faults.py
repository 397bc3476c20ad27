"""Fault injection. For the kill -9 test: with MEGATRON_PDM_KILL_AT=<point>:<step>, global rank 0 SIGKILLs the whole
job (its process group: every rank and the launcher) when it reaches `point` at `step`. Points: `step` (inside an
RL step, after its rollout), `checkpoint_write` (the shards on disk, not yet published) and `weight_sync` (the
engine holds the new weights, the step is not yet logged). For transient failures: with
MEGATRON_PDM_FAIL_AT=<point>:<step>:<rank>, that global rank raises torch.OutOfMemoryError at `point` (point
`checkpoint_load`: loading step_<step>), as a device out of memory would. Unset, each costs one environment
lookup."""

from __future__ import annotations

import os
import signal

KILL_AT = "MEGATRON_PDM_KILL_AT"
FAIL_AT = "MEGATRON_PDM_FAIL_AT"


def kill_point(point: str, step: int, rank: int) -> None:
    if rank == 0 and os.environ.get(KILL_AT) == f"{point}:{step}":
        os.killpg(os.getpgid(0), signal.SIGKILL)


def fail_point(point: str, step: int, rank: int) -> None:
    if os.environ.get(FAIL_AT) == f"{point}:{step}:{rank}":
        import torch

        raise torch.OutOfMemoryError(f"injected at {point} {step} on rank {rank} ({FAIL_AT})")
