"""Weight sync from the trainer into the rollout engine with bounded memory.

Every rank calls `sync_weights`; the engine lives on global rank 0. Each pipeline stage exports its own layers
with `models.hf.hf_buckets_from_model`: every tensor is gathered over its TP / EP / expert-TP owners only onto the
stage's sender (its first rank), converted to the HF layout and put in a bucket of at most `bucket_bytes`. Then,
as the engine says (`RolloutEngine.export_directory`, asked on rank 0 and broadcast):

- the engine loads from disk (SGLang under `weight_sync: disk`, and the update that launches its engines): every
  stage's sender writes its own buckets as shards of one export (`model-pp<stage>-<i>.safetensors`), all stages at
  once; rank 0 gathers their weight maps and the engine completes the export (index, config.json last) and loads
  it (`update_weights_from_export`). No weight crosses between stages.
- otherwise (in memory, a process group, CUDA IPC: the engine's transport starts on rank 0): stage 0's sender is
  rank 0, which hands its buckets to the engine as they come. The sender of stage k > 0 sends each bucket point
  to point to rank 0 (one pickled list of (name, dtype, shape), then one send per tensor) and frees it; rank 0
  receives stage 1's buckets, then stage 2's, ..., handing each to the engine before receiving the next.
  `RolloutEngine.update_weights` consumes the stream one bucket at a time.

The buckets are in the engine's format from the sender on (`sync_weights`' `rollout`, which must be the engine's:
the trainer builds both from precision.rollout): the engine takes them as they come, with no copy of its own (but
the "tensor" transport, which keeps an update's buckets until the update ends, and on a CPU copies each into shared
memory).

Cost per sync, P bytes of weights in the engine's format, S_k the bytes of stage k, T the largest tensor as
gathered:
- memory (beyond each rank's own shards): the sender of each stage holds at most max(B, T) + T bytes (one bucket
  and the tensor being gathered); rank 0 holds one bucket at a time, received or its own. Every other rank: a
  contiguous copy of one shard at most. `weight_sync_peak_bytes` is this
  bound, for the planner. The all-gather path it replaces held P bytes on every rank (plus a pickled copy under PP).
- traffic: each tensor's bytes once over its gather group. To disk: each stage's S_k bytes written once by its
  sender. Otherwise stage k > 0's S_k bytes once more, sender to rank 0 (P (pp - 1) / pp in all with even stages),
  before the engine transport sends P to each engine.
- host syncs: one object broadcast (the export directory, or None) per sync; one dist.gather per tensor (two per
  GLU weight) on its group. To disk: one gather_object of the stages' weight maps. Otherwise per bucket of stage
  k > 0 one object send (a pickle of the names, dtypes and shapes) and one send per tensor.
To disk, the stages export at once: the sync takes the slowest stage's time. Otherwise stages send in order, so
stage k's sender waits while rank 0 forwards the stages before it: the sync takes the sum of the stages' times.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_pdm._bytes import recv_tensors, send_tensors
from megatron_pdm.models import ParallelConfig, ParallelContext, model_chunks, stage_layer_indices
from megatron_pdm.models.config import ModelConfig
from megatron_pdm.models.hf import DEFAULT_BUCKET_BYTES, hf_buckets_from_model, save_hf_shards
from megatron_pdm.objectives.metrics import collective_device


def sync_weights(model, model_cfg: ModelConfig, engine, version: int, ctx: ParallelContext, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, rollout: str = "fp32") -> None:
    """Push this model's weights (a GPTModel or a list of model chunks; HF layout) into `engine` at `version`, in
    the format of a `rollout` engine (precision.rollout) from each shard's owner on: its dtype (shards narrower
    than the parameters converted before they are gathered: bf16 halves what fp32 parameters move), and for fp8
    block-FP8 linear weights (quantized from the parameters' values on each shard owner where the shard holds whole
    128 x 128 blocks, else after the gather on the stage's sender: a quarter of float32's bytes gathered, and the
    same q and scales either way). Call on every rank with the same arguments; `engine` is the rollout
    engine on global rank 0 and None elsewhere. Collective over the whole world (the gathers within each stage;
    the stages' shards written to the engine's export directory, or sent to rank 0)."""
    from megatron_pdm.precision import rollout_engine_dtype

    name, quantization = rollout_engine_dtype(rollout)
    # fp8: the linear weights as block-FP8 pairs, quantized on their shard owners; the rest in the engine's dtype
    buckets = hf_buckets_from_model(model, model_cfg, ctx, bucket_bytes=bucket_bytes, dtype=getattr(torch, name),
                                    fp8=quantization == "fp8")
    if engine is not None and dist.get_rank() != 0:
        raise ValueError(f"sync_weights: the engine must live on global rank 0, not rank {dist.get_rank()}")
    directory = _export_directory(engine, version)
    if directory is not None:
        _export_stages(buckets, directory, engine, version, ctx)
        return
    if engine is None:
        _send_stage(buckets, ctx)
        return
    stream = _rank0_stream(buckets, _device(model), ctx)
    try:
        engine.update_weights(stream, version)
    finally:
        for _ in stream:  # the engine failed mid-way: finish the collectives the other ranks are in
            pass


def _export_directory(engine, version: int) -> Path | None:
    """The engine's `export_directory(version)`, asked on rank 0 and broadcast to every rank (one object broadcast
    over the world: a host sync of a few bytes per sync)."""
    box = [None if engine is None else engine.export_directory(version)]
    dist.broadcast_object_list(box, src=0, device=_staging())
    return None if box[0] is None else Path(box[0])


def _export_stages(buckets, directory: Path, engine, version: int, ctx: ParallelContext) -> None:
    """Each stage's sender writes its own buckets as shards of the export at `directory` (model-pp<stage>-<i>),
    every stage at once; rank 0 gathers their weight maps (one gather_object over the world, after every shard is
    written) and the engine completes and loads the export. Nothing crosses between stages but the maps: a stage's
    bytes go from its sender to the file system once."""
    written = None
    if ctx.roles.sender:
        written = save_hf_shards(directory, buckets, prefix=f"model-pp{ctx.pp_rank:03d}")
    else:
        for _ in buckets:  # drives this rank's part of the stage's gathers; yields nothing here
            pass
    parts = [None] * dist.get_world_size() if engine is not None else None
    dist.gather_object(written, parts, dst=0)
    if engine is None:
        return
    weight_map, nbytes = {}, 0
    for part in filter(None, parts):
        twice = weight_map.keys() & part[0].keys()
        if twice:
            raise ValueError(f"sync_weights: {sorted(twice)[:3]} written by two pipeline stages")
        weight_map |= part[0]
        nbytes += part[1]
    engine.update_weights_from_export(directory, weight_map, nbytes, version)


def _device(model) -> torch.device:
    return next(model_chunks(model)[0].parameters()).device


def _send_stage(buckets, ctx: ParallelContext) -> None:
    """Drive this rank's part of its stage's export; the sender of a stage > 0 sends every bucket to rank 0, then
    an end marker."""
    sends = ctx.roles.sender and ctx.pp_rank > 0
    for bucket in buckets:
        if sends:
            _send_bucket(bucket)
        del bucket
    if sends:
        send_tensors(None, 0, staging=_staging())  # the end marker


def _staging() -> torch.device:
    """Where send/recv_object_list stage their pickled bytes: the current GPU under NCCL, else the CPU."""
    return collective_device(dist.group.WORLD, "cpu")


def _send_bucket(bucket: dict[str, torch.Tensor]) -> None:
    send_tensors(bucket, 0, staging=_staging())


def _rank0_stream(own, device, ctx: ParallelContext) -> Iterator[dict[str, torch.Tensor]]:
    """Rank 0's buckets: its own stage's (stage 0), then each later stage's, received from its sender (the stage's
    first rank) one bucket at a time (each cleared when the next is asked for)."""
    yield from own
    for src in ctx.pipeline_ranks[1:]:
        yield from _receive(src, device)


def _receive(src: int, device) -> Iterator[dict[str, torch.Tensor]]:
    while (mail := recv_tensors(src, device=device, staging=_staging())) is not None:
        bucket = mail[0]
        yield bucket
        bucket.clear()


# ---------------------------------------------------------------------------------------------- the planner's bound


def _attention_numels(cfg: ModelConfig) -> list[int]:
    """One layer's attention export items: GQA's fused q / k / v (its bias, its QK-norm) and output, or MLA's
    projections and latent norms."""
    H, hd, n = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    if cfg.multi_latent_attention:
        q, kv, r, v = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
        query = [q * H, q, n * (hd + r) * q] if q else [n * (hd + r) * H]
        return query + [(kv + r) * H, kv, n * (hd + v) * kv, H * n * v]
    qkv = (n + 2 * cfg.num_query_groups) * hd
    return [qkv * H] + [qkv] * cfg.qkv_bias + [hd, hd] * cfg.qk_norm + [H * n * hd]


def _hf_numels(cfg: ModelConfig, layers: list[int], *, first: bool, last: bool, ep: int) -> list[int]:
    """The elements of every export item of a stage holding `layers` (a full HF tensor; an expert slot counts its
    `ep` experts together, as they are gathered together)."""
    H = cfg.hidden_size
    items = []
    for i in layers:
        items += [H, *_attention_numels(cfg), H]
        if not cfg.is_moe_layer(i):
            items += [2 * cfg.ffn_hidden_size * H, H * cfg.ffn_hidden_size]
            continue
        I, S = cfg.moe_ffn_hidden_size, cfg.moe_shared_expert_ffn_hidden_size  # noqa: E741
        items += [cfg.num_experts * H] + [cfg.num_experts] * (cfg.model_type == "deepseek_v3")  # router, its bias
        items += [2 * S * H, H * S] if S else []
        items += [ep * 2 * I * H, ep * H * I] * (cfg.num_experts // ep)
    if first:
        items.append(cfg.vocab_size * H)
    if last:
        items += [H] + ([] if cfg.tie_word_embeddings else [cfg.vocab_size * H])
    return items


def weight_sync_peak_bytes(model_cfg: ModelConfig, parallel: ParallelConfig, *,
                           bucket_bytes: int = DEFAULT_BUCKET_BYTES, rollout: str = "fp32",
                           holds_update: bool = False) -> int:
    """The most memory one `sync_weights` adds on any rank, in bytes, beyond the model's own shards, for an engine
    of format `rollout` (precision.rollout). With S_k stage k's weights in that format (4, 2 or 2 bytes per element
    for fp32, bf16 / fp16 and fp8: its block-FP8 weights take 1 plus scales, counted as 2), T_k its largest tensor
    as gathered (fp8's quantized weights: 1 byte plus scales, counted as 2, when every TP / expert-TP shard holds
    whole 128 x 128 blocks, else the fp32 parameters' 4; an expert slot counts its EP experts together; expert-TP
    shards are gathered into the same tensors), B = bucket_bytes and b_k = min(max(B, T_k), S_k) the largest
    bucket stage k makes:

        sender of stage k:  b_k + T_k                (a bucket, and the tensor being gathered)
        rank 0:             b_0 + T_0,  and  b_k for every k > 0   (a received bucket; none under a disk export)

    holds_update: the engine keeps every bucket until the update ends ("tensor" sync: SGLang answers before its
    device copies ran), so rank 0 holds sum_k S_k, plus T_0. Returns the largest of these."""
    from megatron_pdm.models.parallel import expert_tensor_parallel_size
    from megatron_pdm.precision import fp8_block_shape_error

    width = 4 if rollout == "fp32" else 2
    owners = rollout == "fp8" and all(fp8_block_shape_error(model_cfg, tp) is None  # quantized before the gathers
                                      for tp in {parallel.tensor, expert_tensor_parallel_size(parallel)})
    gathered = 2 if rollout in ("bf16", "fp16") or owners else 4
    worst, everything, first_largest = 0, 0, 0
    for stage in range(parallel.pipeline):
        items = _hf_numels(model_cfg, stage_layer_indices(model_cfg.num_layers, parallel, stage),
                           first=stage == 0, last=stage == parallel.pipeline - 1, ep=parallel.expert)
        total, largest = sum(items) * width, max(items) * gathered
        everything += total
        first_largest = first_largest or largest
        held = min(max(bucket_bytes, largest), total)
        worst = max(worst, held + largest)
    return max(worst, everything + first_largest) if holds_update else worst
