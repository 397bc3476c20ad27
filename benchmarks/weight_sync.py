"""Weight sync into rollout engines, one run: `--part timing` (seconds per update for each `rollout.sglang.weight_sync`)
and `--part memory` (the peak extra memory of one trainer-side sync, before and after bounded-memory buckets).

timing: launches `--engines` `megatron-pdm serve` engines (the embedded engine behind SGLang's API) for a Qwen3-layout
model of about `--hidden`-sized layers, then times `SGLangEngine.update_weights` (pause, transfer, load,
continue) for disk (HF export + /update_weights_from_disk), distributed (bucketed gloo broadcasts) and tensor
(shared-memory handles), after one warm-up update each: `--rounds` rounds of `--reps` updates per mode, the modes
in a rotated order per round, into the same engines; the median with the spread (min-max). On a GPU machine the
same client drives SGLang with NCCL and CUDA IPC instead; these are the CPU numbers.

format: the same two-process layouts, one `sync_weights` in each engine format: fp32 (what every sync sent before
the senders converted: the engine then made its bf16 / FP8 copy on rank 0), bf16 and fp8 (converted on each
stage's sender: bf16 shards before the gather, FP8 after it); per rank the bytes it gathered in and sent to rank 0
(counted at dist.gather / dist.send) and the peak extra resident memory; a real embedded engine of that format on
rank 0.

memory: two gloo processes (TP = 2, then PP = 2) hold a megatron Qwen3 of `--mem-layers` x `--mem-hidden` (218 M
parameters by default) and a real embedded engine on rank 0; each rank reports the peak resident memory (VmHWM, glibc
returning every block >= 64 KiB at free) that one sync adds: before, `hf_state_from_model` on every rank (the full
HF state everywhere; stages exchange theirs with all_gather_object) + `update_weights(state)`; after,
`train.weight_sync.sync_weights` with buckets of `--buckets-mb`; and the planner's bound `weight_sync_peak_bytes`.

    python benchmarks/weight_sync.py [--part all] [--engines 2] [--reps 3] [--out benchmarks/results/weight_sync.json]
    python benchmarks/weight_sync.py --part format --mem-layers 4   # the engine-format table of docs/sglang.md
    python benchmarks/weight_sync.py --part stages --mem-layers 4 --rounds 4   # stages sending to the engine

stages: two gloo processes at PP = 2 and one launched `serve` engine (bf16); disk and distributed syncs, each with
the later stage relaying through rank 0 (before) and sending to the engine itself (its own shards, its own group),
the four ways in rotated order per round; seconds, bytes sent to rank 0, peak extra resident memory per rank.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_pdm.models import ModelConfig, canonical_hf_state  # noqa: E402
from megatron_pdm.rollout.config import RolloutConfig  # noqa: E402
from megatron_pdm.rollout.sglang.client import WEIGHT_SYNCS, SGLangEngine  # noqa: E402
from megatron_pdm.rollout.sglang.launcher import LaunchSpec  # noqa: E402


def timing(args) -> dict:
    import transformers

    from megatron_pdm.models import hf_config_dict

    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                      num_attention_heads=8, num_query_groups=4, head_dim=args.hidden // 8,
                      ffn_hidden_size=3 * args.hidden, max_position_embeddings=256)
    hcfg = transformers.AutoConfig.for_model(
        **{k: v for k, v in hf_config_dict(cfg).items() if k not in ("architectures", "torch_dtype")})
    state = canonical_hf_state(transformers.AutoModelForCausalLM.from_config(hcfg).state_dict())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    times = {sync: [] for sync in WEIGHT_SYNCS}
    with tempfile.TemporaryDirectory() as tmp:
        # one set of engines for every mode (`weight_sync` may change between updates), the modes interleaved: each
        # round runs every mode --reps times, in a rotated order, so that a noisy minute of a shared machine spreads
        # over all of them instead of landing on one
        spec = LaunchSpec(server="megatron-pdm", num_engines=args.engines, dtype="float32", log_dir=Path(tmp) / "logs")
        section = RolloutConfig(engine="sglang", sync_bucket_bytes=args.bucket_mb << 20,
                                sglang={"weight_sync": "disk", "timeout_s": 600, "update_timeout_s": 600})
        engine = SGLangEngine(section, cfg, weight_dir=Path(tmp) / "weights", launch=spec)
        version = 0
        try:
            engine.update_weights(state, version=version)  # launch
            for sync in WEIGHT_SYNCS:  # a warm-up update each (the distributed group is made at its first)
                engine.weight_sync, version = sync, version + 1
                engine.update_weights(state, version=version)
            for r in range(args.rounds):
                for sync in WEIGHT_SYNCS[r % len(WEIGHT_SYNCS):] + WEIGHT_SYNCS[: r % len(WEIGHT_SYNCS)]:
                    engine.weight_sync = sync
                    for _ in range(args.reps):
                        version += 1
                        t0 = time.perf_counter()
                        engine.update_weights(state, version=version)
                        times[sync].append(time.perf_counter() - t0)
        finally:
            engine.close()
    rows = [{"weight_sync": sync, "seconds": statistics.median(t), "min": min(t), "max": max(t), "all": t}
            for sync, t in times.items()]
    base = rows[0]["seconds"]
    print(f"{nbytes / 2**20:.0f} MiB of fp32 weights ({sum(t.numel() for t in state.values()) / 1e6:.1f} M "
          f"parameters) into {args.engines} engines; median of {args.rounds} interleaved rounds x {args.reps}")
    print(f"{'weight_sync':<12} {'s / update':>11} {'[min-max]':>14} {'GiB/s (all engines)':>20} {'vs disk':>8}")
    for r in rows:
        r["gib_per_s"] = nbytes * args.engines / r["seconds"] / 2**30
        band = f"[{r['min']:.2f}-{r['max']:.2f}]"
        print(f"{r['weight_sync']:<12} {r['seconds']:>11.3f} {band:>14} {r['gib_per_s']:>20.2f} "
              f"{base / r['seconds']:>7.2f}x")
    return {"bytes": nbytes, "engines": args.engines, "reps": args.reps, "rounds": args.rounds, "rows": rows}




def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--part", choices=("all", "timing", "memory", "format", "stages"), default="all")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--mem-hidden", type=int, default=1024)
    ap.add_argument("--mem-layers", type=int, default=12)
    ap.add_argument("--buckets-mb", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--out", default="benchmarks/results/weight_sync.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    if "rows" in results:  # the timing results of before the memory part existed
        results = {"timing": results}
    if args.part in ("all", "timing"):
        results["timing"] = timing(args)
    if args.part in ("all", "memory"):
        results["memory"] = memory(args)
    if args.part in ("all", "format"):
        results["format"] = engine_format(args)
    if args.part in ("all", "stages"):
        results["stages"] = stages(args)
    import torch
    from host import host_info

    # trainer ranks of the memory / format / stages parts run one thread each; engines and timing use the default
    results["host"] = host_info({"default": torch.get_num_threads(), "trainer_ranks_memory_format_stages": 1})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


# ---------------------------------------------------------------------------------------------- memory


def _layouts():
    """TP = 2, then PP = 2: the two layouts every part measures."""
    from megatron_pdm.models import ParallelConfig

    return ParallelConfig(tensor=2), ParallelConfig(pipeline=2)


def _two_ranks(target, cfg, parallel, sizes) -> list[dict]:
    """target(rank, 2, port, cfg, parallel, sizes, queue) in two spawned processes: every row they report."""
    import multiprocessing as mp

    from megatron_pdm.rollout.sglang.launcher import free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(r, 2, port, cfg, parallel, sizes, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = [row for _ in procs for row in queue.get(timeout=3600)]
    for p in procs:
        p.join()
    return rows


def _memory_config(args) -> ModelConfig:
    h = args.mem_hidden
    return ModelConfig(vocab_size=args.vocab, hidden_size=h, num_layers=args.mem_layers, num_attention_heads=16,
                       num_query_groups=8, head_dim=h // 16, ffn_hidden_size=3 * h, max_position_embeddings=256)


def _rank_model(rank: int, world: int, port: int, cfg, parallel):
    """This spawned rank's gloo world, megatron's parallel state and its model shards (glibc returning freed
    blocks, one thread: resident memory follows the live tensors)."""
    import os

    import torch
    import torch.distributed as dist

    from megatron_pdm.models import build_model, initialize_parallel
    from tests.memory import return_freed_memory

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return_freed_memory()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ctx = initialize_parallel(parallel)
    return build_model(cfg, ctx), ctx


def _memory_rank(rank: int, world: int, port: int, cfg, parallel, buckets_mb, queue) -> None:
    import torch.distributed as dist

    from megatron_pdm.models import hf_state_from_model
    from megatron_pdm.rollout import EmbeddedEngine
    from megatron_pdm.train.weight_sync import sync_weights
    from tests.memory import peak_extra_bytes

    model, ctx = _rank_model(rank, world, port, cfg, parallel)
    engine = EmbeddedEngine(cfg) if rank == 0 else None

    def before():
        state = hf_state_from_model(model, cfg, ctx)
        if engine is not None:
            engine.update_weights(state, 0)

    rows = []
    for name, fn in [("all-gather (before)", before)] + [
            (f"buckets of {mb} MiB", lambda mb=mb: sync_weights(model, cfg, engine, 1, ctx, bucket_bytes=mb << 20))
            for mb in buckets_mb]:
        dist.barrier()
        t0 = time.perf_counter()
        peak = peak_extra_bytes(fn)
        rows.append({"sync": name, "rank": rank, "peak_bytes": peak, "seconds": time.perf_counter() - t0})
    queue.put(rows)
    ctx.close()
    dist.destroy_process_group()


def memory(args) -> dict:
    from megatron_pdm.train.weight_sync import weight_sync_peak_bytes

    cfg = _memory_config(args)
    params = cfg.vocab_size * cfg.hidden_size * 2 + cfg.num_layers * (
        (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim * cfg.hidden_size
        + cfg.num_attention_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.ffn_hidden_size * cfg.hidden_size)
    layouts = []
    for parallel in _layouts():
        rows = _two_ranks(_memory_rank, cfg, parallel, args.buckets_mb)
        bounds = {f"buckets of {mb} MiB": weight_sync_peak_bytes(cfg, parallel, bucket_bytes=mb << 20)
                  for mb in args.buckets_mb}
        layouts.append({"parallel": f"TP={parallel.tensor} PP={parallel.pipeline}", "rows": rows, "bounds": bounds})
    print(f"\npeak extra memory of one weight sync, {params / 1e6:.0f} M parameters "
          f"({params * 4 / 2**20:.0f} MiB fp32), 2 gloo processes, MiB")
    print(f"{'layout':<11} {'sync':<21} {'rank 0':>8} {'rank 1':>8} {'bound':>8} {'s':>6}")
    for lay in layouts:
        for name in dict.fromkeys(r["sync"] for r in lay["rows"]):
            by_rank = {r["rank"]: r for r in lay["rows"] if r["sync"] == name}
            bound = lay["bounds"].get(name)
            print(f"{lay['parallel']:<11} {name:<21} {by_rank[0]['peak_bytes'] / 2**20:>8.0f} "
                  f"{by_rank[1]['peak_bytes'] / 2**20:>8.0f} {'' if bound is None else f'{bound / 2**20:.0f}':>8} "
                  f"{max(r['seconds'] for r in by_rank.values()):>6.1f}")
    return {"parameters": params, "model": cfg.__dict__, "layouts": layouts}


# ---------------------------------------------------------------------------------------------- format

FORMATS = (("fp32", "fp32 (before: any engine)"), ("bf16", "bf16 engine"),
           ("fp8-after", "fp8, quantized after gather"), ("fp8", "fp8 engine"))


def _fp8_after_the_gather(model, cfg, engine, ctx, bucket_bytes: int) -> None:
    """The FP8 sync as it was before shard owners quantized: the linear weights gathered in float32 and quantized
    on the stage's sender (`hf_buckets_from_model`'s dtype per key and `convert`), relayed as `sync_weights`
    relays them."""
    import functools

    import torch

    from megatron_pdm.models.hf import hf_buckets_from_model
    from megatron_pdm.precision import fp8_quantizable_name
    from megatron_pdm.rollout.sglang.transports import engine_state
    from megatron_pdm.train import weight_sync

    buckets = hf_buckets_from_model(
        model, cfg, ctx, bucket_bytes=bucket_bytes,
        dtype=lambda key: torch.float32 if fp8_quantizable_name(key) else torch.bfloat16,
        convert=functools.partial(engine_state, fp8=True, dtype="bfloat16"))
    if engine is None:
        weight_sync._send_stage(buckets, ctx)
    else:
        engine.update_weights(weight_sync._rank0_stream(buckets, torch.device("cpu"), ctx), 1)


def _format_rank(rank: int, world: int, port: int, cfg, parallel, bucket_mb: int, queue) -> None:
    import torch.distributed as dist

    from megatron_pdm.precision import rollout_engine_dtype
    from megatron_pdm.rollout import EmbeddedEngine
    from megatron_pdm.train.weight_sync import sync_weights
    from tests.memory import moved_bytes, peak_extra_bytes

    model, ctx = _rank_model(rank, world, port, cfg, parallel)
    rows = []
    for rollout, name in FORMATS:
        dtype, quantization = rollout_engine_dtype(rollout.removesuffix("-after"))
        engine = EmbeddedEngine(cfg, dtype=dtype, quantization=quantization) if rank == 0 else None
        if rollout == "fp8-after":
            def sync(engine=engine):
                _fp8_after_the_gather(model, cfg, engine, ctx, bucket_mb << 20)
        else:
            def sync(rollout=rollout, engine=engine):
                sync_weights(model, cfg, engine, 1, ctx, bucket_bytes=bucket_mb << 20, rollout=rollout)
        dist.barrier()
        t0 = time.perf_counter()
        with moved_bytes() as moved:
            peak = peak_extra_bytes(sync)
        rows.append({"format": name, "rank": rank, "peak_bytes": peak, "seconds": time.perf_counter() - t0, **moved})
        del engine
    queue.put(rows)
    ctx.close()
    dist.destroy_process_group()


def engine_format(args) -> dict:
    cfg = _memory_config(args)
    layouts = []
    for parallel in _layouts():
        rows = _two_ranks(_format_rank, cfg, parallel, args.bucket_mb)
        layouts.append({"parallel": f"TP={parallel.tensor} PP={parallel.pipeline}", "rows": rows})
    print(f"\none weight sync per engine format, {cfg.num_layers} x {cfg.hidden_size} Qwen3 layout, buckets of "
          f"{args.bucket_mb} MiB, 2 gloo processes; MiB gathered in / sent to rank 0, peak extra resident memory")
    print(f"{'layout':<11} {'format':<28} {'r0 in':>7} {'r1 in':>7} {'r1 sent':>8} {'r0 peak':>8} {'r1 peak':>8}")
    for lay in layouts:
        for _, name in FORMATS:
            r = {x["rank"]: x for x in lay["rows"] if x["format"] == name}
            print(f"{lay['parallel']:<11} {name:<28} {r[0]['gathered'] / 2**20:>7.0f} {r[1]['gathered'] / 2**20:>7.0f} "
                  f"{r[1]['sent'] / 2**20:>8.0f} {r[0]['peak_bytes'] / 2**20:>8.0f} {r[1]['peak_bytes'] / 2**20:>8.0f}")
    return {"model": cfg.__dict__, "bucket_mb": args.bucket_mb, "layouts": layouts}


# ---------------------------------------------------------------------------------------------- stages


STAGE_WAYS = {  # name: (rollout.sglang.weight_sync, the engine's answers overridden on rank 0 to take the way before)
    "disk: relay via rank 0 (before)": ("disk", {"export_directory": lambda version: None}),
    "disk: each stage's own shards": ("disk", {}),
    "distributed: relay via rank 0 (before)": ("distributed", {"takes_stage_broadcasts": lambda: False}),
    "distributed: each stage's own group": ("distributed", {}),
}


def _stages_rank(rank: int, world: int, port: int, cfg, parallel, setting, queue) -> None:
    """PP = 2 into a launched `serve` engine (bf16): the first sync launches it; then, in rotated order per round,
    each way of STAGE_WAYS: disk or distributed sync, with the later stage relaying through rank 0 (what every sync
    did before) or sending to the engine itself. One `WeightSync` per rank throughout (a stage's group is kept)."""
    import torch.distributed as dist

    from megatron_pdm.train.weight_sync import WeightSync
    from tests.memory import moved_bytes, peak_extra_bytes

    bucket_mb, rounds, tmp = setting
    model, ctx = _rank_model(rank, world, port, cfg, parallel)
    engine, sync = None, WeightSync()
    if rank == 0:
        spec = LaunchSpec(server="megatron-pdm", num_engines=1, dtype="bfloat16", log_dir=Path(tmp) / "logs")
        section = RolloutConfig(engine="sglang", sync_bucket_bytes=bucket_mb << 20,
                                sglang={"weight_sync": "disk", "timeout_s": 600, "update_timeout_s": 600})
        engine = SGLangEngine(section, cfg, weight_dir=Path(tmp) / "weights", launch=spec, dtype="bfloat16",
                              sync_backend="gloo")
    rows, version, names = [], 0, list(STAGE_WAYS)
    try:
        sync(model, cfg, engine, version, ctx, bucket_bytes=bucket_mb << 20, rollout="bf16")  # launches
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                if engine is not None:
                    mode, overrides = STAGE_WAYS[name]
                    engine.weight_sync = mode
                    for method in ("export_directory", "takes_stage_broadcasts"):
                        engine.__dict__.pop(method, None)
                    engine.__dict__.update(overrides)
                version += 1
                dist.barrier()
                t0 = time.perf_counter()
                with moved_bytes() as moved:
                    peak = peak_extra_bytes(lambda v=version: sync(model, cfg, engine, v, ctx,
                                                                   bucket_bytes=bucket_mb << 20, rollout="bf16"))
                rows.append({"way": name, "rank": rank, "round": r, "peak_bytes": peak,
                             "seconds": time.perf_counter() - t0, **moved})
    finally:
        sync.close()
        if engine is not None:
            engine.close()
    queue.put(rows)
    ctx.close()
    dist.destroy_process_group()


def stages(args) -> dict:
    """The PP = 2 disk and distributed syncs before (every stage through rank 0) and after (each stage sends its
    own layers: its own shards, its own group)."""
    from megatron_pdm.models import ParallelConfig

    cfg = _memory_config(args)
    with tempfile.TemporaryDirectory() as tmp:
        rows = _two_ranks(_stages_rank, cfg, ParallelConfig(pipeline=2), (args.bucket_mb, args.rounds, tmp))
    print(f"\nPP=2 syncs into a launched serve engine (bf16), {cfg.num_layers} x {cfg.hidden_size} Qwen3 layout, "
          f"buckets of {args.bucket_mb} MiB, {args.rounds} rounds of the ways in rotated order; median seconds "
          "[min-max], MiB sent to rank 0 by stage 1, peak extra resident memory per rank (largest)")
    print(f"{'sync':<40} {'s':>6} {'[min-max]':>12} {'r1 sent':>8} {'r0 peak':>8} {'r1 peak':>8}")
    out = []
    for name in dict.fromkeys(r["way"] for r in rows):
        mine = [r for r in rows if r["way"] == name]
        per_round = [max(r["seconds"] for r in mine if r["round"] == k) for k in sorted({r["round"] for r in mine})]
        peaks = {k: max(r["peak_bytes"] for r in mine if r["rank"] == k) for k in (0, 1)}
        sent = max(r["sent"] for r in mine if r["rank"] == 1)
        out.append({"way": name, "seconds": statistics.median(per_round), "min": min(per_round),
                    "max": max(per_round), "sent_bytes": sent, "peak_bytes": peaks, "rows": mine})
        band = f"[{min(per_round):.2f}-{max(per_round):.2f}]"
        print(f"{name:<40} {statistics.median(per_round):>6.2f} {band:>12} {sent / 2**20:>8.0f} "
              f"{peaks[0] / 2**20:>8.0f} {peaks[1] / 2**20:>8.0f}")
    return {"model": cfg.__dict__, "bucket_mb": args.bucket_mb, "ways": out}


if __name__ == "__main__":
    sys.exit(main())
