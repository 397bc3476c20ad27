"""Weight sync from the trainer into the rollout engine with bounded memory.

Every rank calls a `WeightSync` (or the one-off `sync_weights`); the engine lives on global rank 0. Each pipeline
stage exports its own layers with `models.hf.hf_buckets_from_model`: every tensor is gathered over its TP / EP /
expert-TP owners only onto the stage's sender (its first rank), converted to the HF layout and put in a bucket of at
most `bucket_bytes`. Then, as the engine says (asked on rank 0 and broadcast, `_route`):

- the engine loads from disk (`RolloutEngine.export_directory`: SGLang under `weight_sync: disk`, and the update
  that launches its engines): every stage's sender writes its own buckets as shards of one export
  (`model-pp<stage>-<i>.safetensors`), all stages at once, and reports what it wrote to rank 0, which checks that it
  sees those files (`weight_dir` must be one file system for every trainer node and the engines); the engine
  completes the export (index, config.json last) and loads it (`update_weights_from_export`).
- the engine takes each stage's broadcast (`takes_stage_broadcasts`: SGLang under `weight_sync: distributed`, with
  PP > 1): inside one update the engine runs on rank 0 (`update_weights_by_stages`: pause, sessions), every stage's
  sender in turn broadcasts its own buckets over a weights group of its own with every engine rank (stage 0: rank
  0, through the engine's transport; stage k > 0: `rollout.sglang.transports.StageSender`, kept in this
  `WeightSync`), and
  reports the engines that failed under it to rank 0. In turn, not at once: an engine takes one announcement (or
  group init) at a time, so two stages' reaching two engines in opposite orders would deadlock.
- otherwise (in memory, CUDA IPC, one stage): stage 0's sender is rank 0, which hands its buckets to the engine as
  they come. The sender of stage k > 0 sends each bucket point to point to rank 0 (one pickled list of (name,
  dtype, shape), then one send per tensor) and frees it; rank 0 receives stage 1's buckets, then stage 2's, ...,
  handing each to the engine before receiving the next. `RolloutEngine.update_weights` consumes the stream one
  bucket at a time.

The buckets are in the engine's format from the shard owners on (`rollout`, which must be the engine's: the
trainer builds both from precision.rollout, and the engine refuses another before anything loads): the engine takes
them as they come, with no copy of its own (but the "tensor" transport, which keeps an update's buckets until the
update ends, and on a CPU copies each into shared memory).

Cost per sync, P bytes of weights in the engine's format, S_k the bytes of stage k, T the largest tensor as
gathered:
- memory (beyond each rank's own shards): the sender of each stage holds at most max(B, T) + T bytes (one bucket
  and the tensor being gathered); rank 0 holds one bucket at a time, received or its own. Every other rank: a
  contiguous copy of one shard at most (and, for FP8, its q and scales, and the quantization's float32 temporaries
  of under 3 x precision.FP8_QUANTIZE_CHUNK_BYTES). `weight_sync_peak_bytes` is this bound, for the planner. The
  all-gather path it replaces held P bytes on every rank (plus a pickled copy under PP).
- traffic: each tensor's bytes once over its gather group. To disk: each stage's S_k bytes written once by its
  sender. By stage broadcasts: S_k from stage k's sender to each engine rank. Otherwise stage k > 0's S_k bytes
  once more, sender to rank 0 (P (pp - 1) / pp in all with even stages), before the engine transport sends P to
  each engine.
- host syncs: one object broadcast (the route) per sync; one dist.gather per tensor (two per GLU weight) on its
  group. To disk: one object send per stage k > 0 (its report) and one object broadcast (the outcome). By stage
  broadcasts: one object broadcast per stage (its turn) and one object send per stage k > 0 (its report).
  Otherwise per bucket of stage k > 0 one object send (a pickle of the names, dtypes and shapes) and one send per
  tensor.
To disk, the stages export at once: the sync takes the slowest stage's time. Otherwise stages send in turn (by
their own groups, or through rank 0): the sync takes the sum of the stages' times.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_pdm._bytes import recv_tensors, send_tensors
from megatron_pdm.models import ParallelConfig, ParallelContext, model_chunks, stage_layer_indices
from megatron_pdm.models.config import ModelConfig
from megatron_pdm.models.families import layer_tensors, model_tensors, numel
from megatron_pdm.models.hf import DEFAULT_BUCKET_BYTES, hf_buckets_from_model, save_hf_shards
from megatron_pdm.objectives.metrics import collective_device


class WeightSync:
    """One rank's side of the weight sync, kept across syncs (the Learner holds one): where the engines take each
    stage's weights over a group of that stage's own (distributed sync, PP > 1), a later stage's sender keeps its
    group with the engines here (`rollout.sglang.transports.StageSender`). `close` ends it."""

    def __init__(self):
        self.stage_sender = None

    def __call__(self, model, model_cfg: ModelConfig, engine, version: int, ctx: ParallelContext, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, rollout: str = "fp32") -> None:
        """Push this model's weights (a GPTModel or a list of model chunks; HF layout) into `engine` at `version`,
        in the format of a `rollout` engine (precision.rollout) from each shard's owner on: its dtype (shards
        narrower than the parameters converted before they are gathered: bf16 halves what fp32 parameters move),
        and for fp8 block-FP8 linear weights (quantized from the parameters' values on each shard owner where the
        shard holds whole 128 x 128 blocks, else after the gather on the stage's sender: a quarter of float32's
        bytes gathered, and the same q and scales either way). Call on every rank with the same arguments;
        `engine` is the rollout engine on global rank 0 and None elsewhere. Collective over the whole world (the
        gathers within each stage; then, as the engine takes them, the stages' shards written to its export
        directory, or broadcast by each stage's sender over its own group, or sent to rank 0)."""
        from megatron_pdm.precision import rollout_engine_dtype

        name, quantization = rollout_engine_dtype(rollout)
        fmt = (name, quantization == "fp8")
        # fp8: the linear weights as block-FP8 pairs, quantized on their shard owners; the rest in the engine's dtype
        buckets = hf_buckets_from_model(model, model_cfg, ctx, bucket_bytes=bucket_bytes,
                                        dtype=getattr(torch, name), fp8=fmt[1])
        if engine is not None and dist.get_rank() != 0:
            raise ValueError(f"sync_weights: the engine must live on global rank 0, not rank {dist.get_rank()}")
        route = _route(engine, version, ctx)
        if route == "stages":
            self._broadcast_stages(buckets, engine, version, ctx, fmt)
        elif route is not None:
            _export_stages(buckets, route, engine, version, ctx, fmt)
        elif engine is None:
            _send_stage(buckets, ctx)
        else:
            stream = _rank0_stream(buckets, _device(model), ctx)
            try:
                engine.update_weights(stream, version)
            finally:
                for _ in stream:  # the engine failed mid-way: finish the collectives the other ranks are in
                    pass

    def _broadcast_stages(self, buckets, engine, version: int, ctx: ParallelContext, fmt: tuple[str, bool]) -> None:
        """Each stage's sender broadcasts its own buckets to the engines over a weights group of its own (stage 0:
        rank 0, through the engine's transport; stage k > 0: `StageSender`), inside one update that the engine runs
        on rank 0 (`update_weights_by_stages`: pause, sessions, failed engines). Stages take turns: rank 0 opens
        each turn with one object broadcast over the world (stage 0's, then each later stage's plan, or None to
        skip it after an abort) and takes the stage's report (one object send). No weight crosses between stages.
        Should the engine fail before the first turn, rank 0 broadcasts None instead and every rank raises."""
        if engine is not None:
            return self._run_turns(buckets, engine, version, ctx, fmt)
        box = [None]
        dist.broadcast_object_list(box, src=0, device=_staging())
        if box[0] is None:
            raise RuntimeError("sync_weights: rank 0's rollout engine failed before the stages sent their weights")
        if ctx.pp_rank == 0:
            for _ in buckets:  # this rank's part of stage 0's gathers, which rank 0 sends
                pass
        error = None
        for stage in range(1, ctx.pp):
            box = [None]
            dist.broadcast_object_list(box, src=0, device=_staging())
            plan = box[0]["plan"]
            if stage != ctx.pp_rank or plan is None:
                continue
            if not ctx.roles.sender:
                for _ in buckets:  # this rank's part of its stage's gathers
                    pass
                continue
            from megatron_pdm.rollout.sglang.transports import StageSender

            try:
                self.stage_sender = self.stage_sender or StageSender(ctx.pp_rank)
                report = self.stage_sender.send(buckets, version, plan)
            except Exception as e:  # reported (rank 0 fails the update with it), raised after the last turn
                error, report = e, {"stage": ctx.pp_rank, "error": f"{type(e).__name__}: {e}"}
            finally:
                for _ in buckets:  # the rest of the stage's gathers, whatever failed
                    pass
            dist.send_object_list([report], dst=0, device=_staging())
        if error is not None:
            raise error

    @staticmethod
    def _run_turns(buckets, engine, version: int, ctx: ParallelContext, fmt: tuple[str, bool]) -> None:
        """Rank 0's side of `_broadcast_stages`: the engine calls `send` once it is ready for the weights."""
        turns = []

        def send(own, next_plan) -> None:
            turns.append(0)
            dist.broadcast_object_list([{"plan": "stage 0"}], src=0, device=_staging())
            error, report = None, None
            try:
                own(buckets)
            except Exception as e:  # the later stages are skipped, then it is raised
                error = e
            finally:
                for _ in buckets:
                    pass
            for src in ctx.pipeline_ranks[1:]:
                plan = None
                if error is None:
                    try:
                        plan = next_plan(report)
                    except Exception as e:
                        error = e
                dist.broadcast_object_list([{"plan": plan}], src=0, device=_staging())
                report = _recv_report(src) if plan is not None else None
            if error is None:
                next_plan(report)  # the last stage's report: its failed engines, its abort
            if error is not None:
                raise error

        try:
            engine.update_weights_by_stages(version, send, dtype=fmt[0], fp8=fmt[1])
        finally:
            if not turns:
                dist.broadcast_object_list([None], src=0, device=_staging())

    def close(self) -> None:
        """Destroy this rank's stage group with the engines, if it holds one."""
        if self.stage_sender is not None:
            self.stage_sender.close()
            self.stage_sender = None


def sync_weights(model, model_cfg: ModelConfig, engine, version: int, ctx: ParallelContext, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, rollout: str = "fp32") -> None:
    """One `WeightSync` (its docstring), its stage groups ended after it."""
    once = WeightSync()
    try:
        once(model, model_cfg, engine, version, ctx, bucket_bytes=bucket_bytes, rollout=rollout)
    finally:
        once.close()


def _route(engine, version: int, ctx: ParallelContext) -> Path | str | None:
    """How the stages' weights reach the engine, asked on rank 0 and broadcast to every rank (one object broadcast
    over the world: a host sync of a few bytes per sync): the engine's `export_directory(version)` as an absolute
    path (rank 0's working directory made explicit; symbolic links left for each node to follow); "stages" when,
    under PP, it takes each stage's broadcast over the stage's own group (`takes_stage_broadcasts`); None: through
    rank 0. An engine failing to answer fails every rank
    together (the others would wait in the next collective)."""
    box = [None]
    if engine is not None:
        try:
            found = engine.export_directory(version)
            box = [str(Path(found).absolute()) if found is not None
                   else "stages" if ctx.pp > 1 and engine.takes_stage_broadcasts(single_node=_single_node()) else None]
        except Exception as e:
            box = [("error", f"{type(e).__name__}: {e}")]
            dist.broadcast_object_list(box, src=0, device=_staging())
            raise
    dist.broadcast_object_list(box, src=0, device=_staging())
    if isinstance(box[0], tuple):
        raise RuntimeError(f"sync_weights: rank 0's rollout engine failed: {box[0][1]}")
    return box[0] if box[0] in (None, "stages") else Path(box[0])


def _export_stages(buckets, directory: Path, engine, version: int, ctx: ParallelContext, fmt: tuple[str, bool]
                   ) -> None:
    """Each stage's sender writes its own buckets as shards of the export at `directory` (model-pp<stage>-<i>),
    every stage at once, and reports to rank 0 what it wrote (one object send per stage > 0); rank 0 checks that it
    sees those files (`weight_dir` must be one file system for every trainer node and the engines) and broadcasts
    the outcome (one object broadcast), so that a stage that could not write (a full disk) fails every rank
    together, naming it; then the engine completes and loads the export (`update_weights_from_export`, in the
    format `fmt` = (dtype, fp8)). Nothing crosses between stages but the reports: a stage's bytes go from its
    sender to the file system once. A sender whose write failed still runs its stage's gathers to the end."""
    report = None
    if ctx.roles.sender:
        try:
            report = (ctx.pp_rank, *save_hf_shards(directory, buckets, prefix=f"model-pp{ctx.pp_rank:03d}"), None)
        except Exception as e:
            report = (ctx.pp_rank, {}, 0, {}, f"{type(e).__name__}: {e}")
    for _ in buckets:  # this rank's part of the stage's gathers (after a failed write: the rest of them)
        pass
    outcome = [None]
    if engine is not None:
        reports = [report] + [_recv_report(src) for src in ctx.pipeline_ranks[1:]]
        try:
            outcome = [_check_reports(reports, directory)]
        except Exception as e:  # e.g. a stale NFS handle: every rank fails with it, none waits for the outcome
            outcome = [f"sync_weights: checking the export at {directory}: {type(e).__name__}: {e}"]
    elif ctx.roles.sender and ctx.pp_rank > 0:
        dist.send_object_list([report], dst=0, device=_staging())
    dist.broadcast_object_list(outcome, src=0, device=_staging())
    if isinstance(outcome[0], str):
        raise RuntimeError(outcome[0])
    if engine is not None:
        weight_map, nbytes = outcome[0]
        engine.update_weights_from_export(directory, weight_map, nbytes, version, dtype=fmt[0], fp8=fmt[1])


def _single_node() -> bool:
    """Whether every rank runs on this node (torchrun's LOCAL_WORLD_SIZE; a world started otherwise counts as one
    node)."""
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) == dist.get_world_size()


def _recv_report(src: int):
    box = [None]
    dist.recv_object_list(box, src=src, device=_staging())
    return box[0]


def _check_reports(reports, directory: Path) -> tuple[dict[str, str], int] | str:
    """The export's (weight map, bytes) from the stages' reports, or what is wrong with it: a stage that failed to
    write, a key written twice, or a file rank 0 does not see as it was written (a weight_dir that is not shared)."""
    weight_map, nbytes = {}, 0
    for stage, part, size, sizes, error in reports:
        if error is not None:
            return f"sync_weights: stage {stage}'s sender could not write its shards of {directory}: {error}"
        twice = weight_map.keys() & part.keys()
        if twice:
            return f"sync_weights: {sorted(twice)[:3]} written by two pipeline stages"
        for name, written in sizes.items():
            path = directory / name
            seen = path.stat().st_size if path.is_file() else None
            if seen != written:
                return (f"rollout.sglang.weight_dir: stage {stage}'s sender wrote {path} ({written} bytes), which "
                        f"rank 0 {'does not see' if seen is None else f'sees with {seen} bytes'}: disk weight sync "
                        "needs a weight_dir on one file system shared by every trainer node and the engines")
        weight_map |= part
        nbytes += size
    return weight_map, nbytes


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


def _hf_numels(cfg: ModelConfig, layers: list[int], *, first: bool, last: bool, ep: int) -> list[int]:
    """The elements of every export item of a stage holding `layers` (a full HF tensor, from the family's tensor
    list; an expert slot counts its `ep` experts together, as they are gathered together)."""
    per_kind = {}  # a layer's tensors depend on i only through is_moe_layer(i) (families.Family.layer)
    for i in layers:
        if (moe := cfg.is_moe_layer(i)) not in per_kind:
            per_kind[moe] = _layer_numels(cfg, i, ep)
    head, tail = model_tensors(cfg, first=first, last=last)
    return [n for i in layers for n in per_kind[cfg.is_moe_layer(i)]] + [numel(t) for t in head + tail]


def _layer_numels(cfg: ModelConfig, i: int, ep: int) -> list[int]:
    """Layer i's export items: each tensor, and per slot (the first E / ep experts' rows) its ep experts'."""
    slots = cfg.num_experts // ep
    return [ep * numel(t) if t.kind.startswith("expert") else numel(t) for t in layer_tensors(cfg, i)
            if not t.kind.startswith("expert") or int(t.megatron.rsplit("#", 1)[1]) < slots]


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
        rank 0:             b_0 + T_0,  and  b_k for every k > 0   (a received bucket: none to disk or by stage
                                                                     broadcasts)
        fp8, every rank:    3 x precision.FP8_QUANTIZE_CHUNK_BYTES more (the quantization's float32 temporaries)

    holds_update: the engine keeps every bucket until the update ends ("tensor" sync: SGLang answers before its
    device copies ran), so rank 0 holds sum_k S_k, plus T_0. Returns the largest of these."""
    from megatron_pdm.models.parallel import expert_tensor_parallel_size
    from megatron_pdm.precision import FP8_QUANTIZE_CHUNK_BYTES, fp8_block_shape_error

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
    quantizing = 3 * FP8_QUANTIZE_CHUNK_BYTES if rollout == "fp8" else 0
    return (max(worst, everything + first_largest) if holds_update else worst) + quantizing
