"""`EngineSpec`: what one rollout engine supplies besides the `RolloutEngine` it builds, so that the config checks,
`plan` and `submit` ask the engine instead of testing its name (the registry: engines.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SlurmJob:
    """What `megatron-pdm submit` tells an engine's launch block about the job: `python` the interpreter that
    renders it (the batch shell's), `job_python` the one the job runs (`python` inside a container), whether to
    start a `router`, the first engine and the router's ports, and `colocated_fraction()`, the share of each GPU
    that `plan` leaves engines beside the trainer (a plan: called only for colocated engines on GPUs)."""

    python: str
    job_python: str
    router: bool
    engine_port: int
    router_port: int
    colocated_fraction: Callable[[], float]


@dataclass(frozen=True)
class EngineSpec:
    """One rollout engine, as the registry (engines.py) names it:

    - build(rollout, model_cfg, precision_cfg, *, dtype, quantization, run_dir, tokenizer_dir) -> RolloutEngine,
      not started;
    - config: the dataclass of its sub-section `rollout.<name>` (None: no settings of its own); `moved`, the keys
      of that sub-section that an older release read flat under `rollout` (the config loader moves them, warning);
      `exclusive`, those its `validate` refuses outright under another engine (the others only do nothing there);
    - validate(rollout): checks across the rollout section, at load; check_run(cfg): checks against the whole run
      config (model, cluster), at load; check_tp(cfg, tp, field): that engines of `tp` GPUs can serve the model;
    - servers: it runs in servers of its own (then `plan` sizes them and precision.kv_cache, cluster.engine_image
      act), and slurm_block(cfg, job: SlurmJob) -> the batch script's lines that start them and add the overrides
      that point the trainer at them; environment(cfg): where they run, as `plan` reports it."""

    name: str
    build: Callable
    config: type | None = None
    moved: tuple[str, ...] = ()
    exclusive: tuple[str, ...] = ()
    validate: Callable | None = None
    check_run: Callable | None = None
    check_tp: Callable | None = None
    servers: bool = False
    slurm_block: Callable | None = None
    environment: Callable | None = None
