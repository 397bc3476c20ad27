"""Weight sync from the trainer into the rollout engine with bounded memory.

Every rank calls `sync_weights`; the engine lives on global rank 0. Each pipeline stage exports its own layers
with `models.hf.hf_buckets_from_model`: every tensor is gathered over its TP / EP / expert-TP owners only onto the
stage's sender (its first rank), converted to the HF layout and put in a bucket of at most `bucket_bytes`. Stage 0's
sender is rank 0, which hands its buckets to the engine as they come. The sender of stage k > 0 sends each bucket
point to point to rank 0 (one pickled list of (name, dtype, shape), then one send per tensor) and frees it; rank 0
receives stage 1's buckets, then stage 2's, ..., handing each to the engine before receiving the next.
`RolloutEngine.update_weights` consumes the stream one bucket at a time.

Cost per sync, P bytes of weights in the export dtype, S_k the bytes of stage k, T the largest tensor:
- memory (beyond each rank's own shards): the sender of each stage holds at most max(B, T) + T bytes (one bucket
  and the tensor being gathered); rank 0 holds one bucket at a time, received or its own, plus what the engine
  makes of it (the SGLang client's copy in the rollout dtype or block FP8, the "tensor" transport's shared-memory
  copy: one more bucket). Every other rank: a contiguous copy of one shard at most. `weight_sync_peak_bytes` is this
  bound, for the planner. The all-gather path it replaces held P bytes on every rank (plus a pickled copy under PP).
- traffic: each tensor's bytes once over its gather group; stage k > 0's S_k bytes once more, sender to rank 0
  (P (pp - 1) / pp in all with even stages), before the engine transport sends P to each engine.
- host syncs: one dist.gather per tensor (two per GLU weight) on its group; per bucket of stage k > 0 one object
  send (a pickle of the names, dtypes and shapes) and one send per tensor.
Stages send in order, so stage k's sender waits while rank 0 forwards the stages before it: the sync takes the
sum of the stages' times, as the all-gather did.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_pdm._bytes import as_bytes
from megatron_pdm.models.config import ModelConfig
from megatron_pdm.models.gpt import ParallelConfig, model_chunks, stage_layer_indices
from megatron_pdm.models.hf import DEFAULT_BUCKET_BYTES, hf_buckets_from_model, sync_roles
from megatron_pdm.objectives.metrics import collective_device


def sync_weights(model, model_cfg: ModelConfig, engine, version: int, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype=torch.float32) -> None:
    """Push this model's weights (a GPTModel or a list of model chunks; HF layout, `dtype`) into `engine` at
    `version`. Call on every rank with the same arguments; `engine` is the rollout engine on global rank 0 and None
    elsewhere. Collective over the whole world (the gathers within each stage, the stages' sends to rank 0)."""
    buckets = hf_buckets_from_model(model, model_cfg, bucket_bytes=bucket_bytes, dtype=dtype)
    if engine is None:
        _send_stage(buckets)
        return
    if dist.get_rank() != 0:
        raise ValueError(f"sync_weights: the engine must live on global rank 0, not rank {dist.get_rank()}")
    stream = _rank0_stream(buckets, _device(model))
    try:
        engine.update_weights(stream, version)
    finally:
        for _ in stream:  # the engine failed mid-way: finish the collectives the other ranks are in
            pass


def _device(model) -> torch.device:
    return next(model_chunks(model)[0].parameters()).device


def _pipeline():
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()


def _send_stage(buckets) -> None:
    """Drive this rank's part of its stage's export; the sender of a stage > 0 sends every bucket to rank 0, then
    an end marker."""
    group, stage = _pipeline()
    sends = sync_roles().sender and stage > 0
    for bucket in buckets:
        if sends:
            _send_bucket(bucket)
        del bucket
    if sends:
        dist.send_object_list([None], dst=0, device=_staging())


def _staging() -> torch.device:
    """Where send/recv_object_list stage their pickled bytes: the current GPU under NCCL, else the CPU."""
    return collective_device(dist.group.WORLD, "cpu")


def _send_bucket(bucket: dict[str, torch.Tensor]) -> None:
    meta = [(k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in bucket.items()]
    dist.send_object_list([meta], dst=0, device=_staging())
    for t in bucket.values():
        dist.send(as_bytes(t), dst=0)


def _rank0_stream(own, device) -> Iterator[dict[str, torch.Tensor]]:
    """Rank 0's buckets: its own stage's (stage 0), then each later stage's, received from its sender one bucket
    at a time (each cleared when the next is asked for)."""
    yield from own
    group, _ = _pipeline()
    for stage in range(1, dist.get_world_size(group)):
        yield from _receive(dist.get_global_rank(group, stage), device)


def _receive(src: int, device) -> Iterator[dict[str, torch.Tensor]]:
    while True:
        box = [None]
        dist.recv_object_list(box, src=src, device=_staging())
        if box[0] is None:
            return
        bucket = {}
        for key, dtype, shape in box[0]:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.recv(as_bytes(t), src=src)
            bucket[key] = t
        yield bucket
        bucket.clear()


# ---------------------------------------------------------------------------------------------- the planner's bound


def _hf_numels(cfg: ModelConfig, layers: list[int], *, first: bool, last: bool, ep: int) -> list[int]:
    """The elements of every export item of a stage holding `layers` (a full HF tensor; an expert slot counts its
    `ep` experts together, as they are gathered together)."""
    H, hd = cfg.hidden_size, cfg.head_dim
    per_layer = [H, (cfg.num_attention_heads + 2 * cfg.num_query_groups) * hd * H, hd, hd,
                 H * cfg.num_attention_heads * hd, H]
    if cfg.is_moe:
        slots = cfg.num_experts // ep
        I = cfg.moe_ffn_hidden_size  # noqa: E741
        per_layer += [cfg.num_experts * H] + [ep * 2 * I * H, ep * H * I] * slots
    else:
        per_layer += [2 * cfg.ffn_hidden_size * H, H * cfg.ffn_hidden_size]
    items = per_layer * len(layers)
    if first:
        items.append(cfg.vocab_size * H)
    if last:
        items += [H] + ([] if cfg.tie_word_embeddings else [cfg.vocab_size * H])
    return items


def weight_sync_peak_bytes(model_cfg: ModelConfig, parallel: ParallelConfig, *,
                           bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype_bytes: int = 4,
                           engine_copy: bool = True) -> int:
    """The most memory one `sync_weights` adds on any rank, in bytes, beyond the model's own shards. With S_k stage
    k's weights in the export dtype (`dtype_bytes` per element, 4 for float32), T_k its largest tensor (an expert
    slot counts its EP experts together; expert-TP shards are gathered into the same tensors), B = bucket_bytes and
    b_k = min(max(B, T_k), S_k) the largest bucket stage k makes:

        sender of stage k:  b_k + T_k                          (a bucket, and the tensor being gathered)
        rank 0:             b_0 + T_0 + c b_0,  and  (1 + c) b_k for every k > 0   (a received bucket)

    c = 1 with engine_copy (the SGLang client's copy of a bucket in the rollout dtype or block FP8, the "tensor"
    transport's shared-memory copy), else 0. Returns the largest of these."""
    c = 1 if engine_copy else 0
    worst = 0
    for stage in range(parallel.pipeline):
        items = _hf_numels(model_cfg, stage_layer_indices(model_cfg.num_layers, parallel, stage),
                           first=stage == 0, last=stage == parallel.pipeline - 1, ep=parallel.expert)
        total, largest = sum(items) * dtype_bytes, max(items) * dtype_bytes
        held = min(max(bucket_bytes, largest), total)
        rank0 = held + largest + c * held if stage == 0 else (1 + c) * held
        worst = max(worst, held + largest, rank0)
    return worst
