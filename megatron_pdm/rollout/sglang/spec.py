"""The SGLang engine's `EngineSpec`: how it is built, checked, sized and launched (settings: `rollout.sglang`)."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

from megatron_pdm._rundir import RunDir

from ..spec import EngineSpec
from .config import SGLangConfig
from .launcher import LaunchSpec, check_engine_heads, cpu_sglang
from .slurm import slurm_block

NAME = "sglang"
EXCLUSIVE = ("release_memory", "router", "num_engines", "urls")  # refused under another engine (`validate`)


def launch_spec(rollout, *, dtype: str, kv_cache_dtype: str, run_dir) -> LaunchSpec | None:
    """The servers `rollout` launches (None when it attaches to `rollout.sglang.urls`): `num_engines` of `engine_tp`
    GPUs in the rollout dtype and KV-cache dtype of the precision section, logging under <run dir>/logs. No online
    quantization: SGLang takes no weight updates into an engine that quantizes its own checkpoint, so FP8 engines
    start from block-FP8 weights (fp8_export.py) and are sent block-FP8 ones."""
    s = rollout.sglang
    if not s.num_engines:
        return None
    return LaunchSpec(server=s.server, num_engines=s.num_engines, tp=s.engine_tp, dtype=dtype, quantization=None,
                      kv_cache_dtype=kv_cache_dtype, server_args=s.server_args, routed_experts=rollout.routed_experts,
                      memory_saver=s.release_memory and s.server == "sglang", log_dir=RunDir(run_dir).logs,
                      python=s.engine_python or sys.executable)


def export_dir(rollout, run_dir) -> Path:
    """Where disk weight syncs export: `rollout.sglang.weight_dir`, by default <run dir>/weights."""
    return Path(rollout.sglang.weight_dir) if rollout.sglang.weight_dir else RunDir(run_dir).weights


def build(rollout, model_cfg, precision_cfg, *, dtype: str, quantization: str | None, run_dir: Path,
          tokenizer_dir):
    """An `SGLangEngine` attached to `rollout.sglang.urls`, or launching `num_engines` servers (`server` sglang or
    megatron-pdm) from the first weights, logging under <run_dir>/logs and exporting weights under `weight_dir`
    (default <run_dir>/weights). FP8 engines start from, and are sent, block-FP8 weights."""
    from .client import SGLangEngine

    s = rollout.sglang
    if not s.urls and not s.num_engines:
        raise ValueError("rollout.sglang.urls / rollout.sglang.num_engines: the sglang engine needs worker URLs or a "
                         "number of engines to launch (megatron-pdm submit fills in the URLs of those it starts)")
    if s.num_engines and s.server == "sglang" and s.weight_sync == "distributed":
        import torch

        if torch.cuda.is_available():  # engine 0 starts at GPU 0 (--base-gpu-id), where rank 0 trains
            raise ValueError("rollout.sglang.weight_sync: 'distributed' with engines launched on the trainer's GPUs "
                             "(rollout.sglang.num_engines): engine 0's first rank shares GPU 0 with the trainer's "
                             "rank 0, and one NCCL group cannot hold both; use 'tensor' or 'disk'")
    launch = launch_spec(rollout, dtype=dtype, kv_cache_dtype=precision_cfg.kv_cache, run_dir=run_dir)
    # one bucket size (rollout.sync_bucket_bytes): the trainer's buckets, sent as they come
    return SGLangEngine(rollout, model_cfg, weight_dir=export_dir(rollout, run_dir), launch=launch,
                        quantization=quantization, dtype=dtype, tokenizer_dir=tokenizer_dir)


def validate(rollout) -> None:
    """The checks of `rollout.sglang` against the rest of the rollout section: the settings only this engine reads
    are refused under another one; no memory release on a CPU SGLang server or under an off-policy schedule."""
    s = rollout.sglang
    if rollout.engine != NAME:
        for name in EXCLUSIVE:
            if getattr(s, name) != getattr(SGLangConfig(), name):
                raise ValueError(f"rollout.sglang.{name}: {getattr(s, name)!r} applies to the sglang engine only "
                                 f"(rollout.engine is {rollout.engine!r})")
        return
    if s.release_memory and s.server == "sglang" and cpu_sglang(s.server_args):
        raise ValueError("rollout.sglang.release_memory: true with SGLang engines on a CPU (rollout.sglang.server_args "
                         "--device cpu, or SGLANG_USE_CPU_ENGINE=1): /release_memory_occupation kills a CPU SGLang "
                         "server (0.5.23 synchronizes a CUDA device there); set it false")
    if (rollout.schedule == "streaming" or (rollout.schedule == "lagged" and rollout.lag)) and s.release_memory:
        raise ValueError(f"rollout.schedule: {rollout.schedule!r} generates between the weight updates, while the "
                         "trainer holds the GPUs, which colocated engines cannot (rollout.sglang.release_memory: true "
                         "frees their memory until the next update); use schedule 'sync', or engines on GPUs of "
                         "their own")


def check_run(cfg) -> None:
    """The checks against the whole run config: the engines' TP shards the model's heads; the engines a cluster job
    starts on GPUs are reachable by the weight sync ("distributed" puts the trainer's rank 0 and every engine rank in
    one NCCL group, which cannot hold two ranks on one GPU, as colocated engines share rank 0's; "tensor" hands CUDA
    IPC handles from rank 0, which only processes on its node can open)."""
    s, c = cfg.rollout.sglang, cfg.cluster
    if cfg.on_cluster and c.gpu != "cpu":
        if s.weight_sync == "distributed" and not c.rollout_nodes:
            raise ValueError("rollout.sglang.weight_sync: 'distributed' with the engines colocated on the training "
                             "nodes (cluster.rollout_nodes 0): an engine rank shares the GPU of the trainer's rank 0, "
                             "and one NCCL group cannot hold both; use 'tensor' (one node) or 'disk', or give the "
                             "engines nodes of their own (cluster.rollout_nodes)")
        if s.weight_sync == "tensor" and (c.rollout_nodes or c.nodes > 1):
            where = (f"on {c.rollout_nodes} node(s) of their own" if c.rollout_nodes else
                     f"on all {c.nodes} training nodes")
            raise ValueError(f"rollout.sglang.weight_sync: 'tensor' with engines {where}: it hands CUDA IPC handles "
                             "from the trainer's rank 0, which only processes on its node can open; use 'distributed' "
                             "(engines on nodes of their own) or 'disk'")
    if s.engine_tp > 1:  # SGLang shards the heads over its TP
        check_engine_heads(cfg.model, s.engine_tp, field="rollout.sglang.engine_tp", server_args=s.server_args)


def check_tp(cfg, tp: int, field: str) -> None:
    """SGLang engines of `tp` GPUs shard the attention heads over their (attention) TP; FP8 ones start from block-FP8
    weights, whose 128 x 128 blocks each GPU's shard must hold whole."""
    check_engine_heads(cfg.model, tp, field=field, server_args=cfg.rollout.sglang.server_args)
    if cfg.precision.rollout == "fp8":
        from megatron_pdm.precision import check_fp8_block_shapes

        check_fp8_block_shapes(cfg.model, tp, field=field)


def environment(cfg) -> str:
    """Where the engines run, as `plan` reports it."""
    return ", ".join(f"{k} {v}" for k, v in (("rollout.sglang.engine_python", cfg.rollout.sglang.engine_python),
                                             ("cluster.engine_image", cfg.cluster.engine_image)) if v) \
        or "the trainer's environment (rollout.sglang.engine_python unset)"


SPEC = EngineSpec(name=NAME, build=build, config=SGLangConfig, moved=tuple(f.name for f in fields(SGLangConfig)),
                  exclusive=EXCLUSIVE,
                  validate=validate, check_run=check_run, check_tp=check_tp, servers=True, slurm_block=slurm_block,
                  environment=environment)
