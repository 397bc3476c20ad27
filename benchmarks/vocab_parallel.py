"""Time, peak memory and communication of the vocab-parallel PDM statistics against two baselines.

  (a) ours:      policy_statistics(topk_kl, K) = log pi(k) with backward + top-K KL + Ddot (+ entropy)
  (b) megatron:  megatron.core.tensor_parallel.vocab_parallel_cross_entropy, forward + backward
  (c) gather:    all-gather the logits shard, log_softmax on the full vocabulary, top-K KL + Ddot, backward
                 (what single-device trainers do)

Each (variant, V, TP) runs in fresh processes (gloo, one per TP rank) on bf16 logits [T, V/tp]. Peak memory is
the growth of the resident set over the op (VmHWM after `clear_refs` reset, minus VmRSS before), the maximum
over ranks, with glibc's mmap threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_) so that every freed tensor
leaves the resident set at once and RSS tracks live tensors (with the default dynamic threshold, freed heap
blocks stay resident and the first call's peak depends on the allocator's history); communication is the
bytes each rank hands to torch.distributed collectives, counted by wrapping them. Prints a table of ratios
to (b), a table of TP scaling (each variant's time at TP = tp over its time at TP = 1) and writes JSON.

Every run shares the machine's cores: each rank gets max(1, cpus // tp) threads. With tp above the core count
(TP = 4 on 2 cores: 4 single-thread processes on 2 cores) the ranks time-share, so those rows measure the
per-rank work and the collective count at that TP size, not a speed-up. (c) keeps the full [T, V] logits on
every rank (~14 bytes per logit at its peak): a case whose tp copies would not fit in the available memory
is skipped and recorded with null time and memory.

Times are measured honestly on a shared machine: `--rounds` rounds, each running every (V, TP, variant) once in
fresh processes, the variants of a case in a rotated order per round (so that none always runs first or right
after another). A variant's time is the median over rounds of its per-round median over `--reps` repetitions,
reported with the spread over rounds (min-max); each ratio is the median over rounds of the per-round ratio,
with its spread. Memory is measured once per (V, TP, variant).

Loaded mode (`--load N`, N > 0): each round also runs every case with N background processes on the same cores,
each doing one-thread float32 matrix products (started before, stopped after that half of the round; the quiet and
loaded halves alternate in order). Reported as well: the ratios under load and each variant's slowdown, the median
of the per-round loaded / quiet times. Under a fair scheduler a process that runs C threads on C cores gets C^2 /
(C + N) cores against N busy threads, so it slows (C + N) / C at best: 1.5x at the default N = C / 2 (rounded up).
A slowdown above that is time lost waiting on descheduled threads (an op on n threads ends at a barrier). The JSON
names the host (benchmarks/host.py: CPU model, flags, torch's CPU capability, threads per rank).

    python benchmarks/vocab_parallel.py [--tokens 4096] [--vocab 32768 151936] [--tp 1 2 4] [--reps 3]
                                        [--rounds 3] [--load N] [--variants ours megatron gather]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/vocab_parallel.py ...  # an AVX2-only host
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from host import host_info, host_line

VARIANTS = ("ours", "megatron", "gather")
GATHER_BYTES_PER_LOGIT = 14  # (c)'s peak resident set per rank over T * V, measured: 8314 MiB at 4096 x 151936
LOAD_MATRIX = 512  # the background load: float32 [512, 512] @ [512, 512] products, a few ms each on one thread


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _fits(variant, T, V, tp) -> bool:
    return variant != "gather" or tp * T * V * GATHER_BYTES_PER_LOGIT <= 0.8 * _available_bytes()


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _count_collectives(counter: dict) -> None:
    import torch.distributed as dist

    def wrap(name, nbytes):
        fn = getattr(dist, name, None)
        if fn is None:
            return

        def counted(*args, **kwargs):
            counter["bytes"] += nbytes(*args)
            counter["calls"] += 1
            return fn(*args, **kwargs)

        setattr(dist, name, counted)

    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    wrap("all_reduce", lambda t, *a: size(t))
    wrap("all_gather_single", lambda out, inp, *a: size(inp))
    wrap("all_gather_into_tensor", lambda out, inp, *a: size(inp))
    wrap("all_gather", lambda outs, inp, *a: size(inp))


def _inputs(T, width, K, rank, world, seed=0):
    from megatron_pdm.vocab_parallel import BehaviorTopK

    g = torch.Generator().manual_seed(seed)
    V = width * world
    token_ids = torch.randint(0, V, (T,), generator=g)
    topk_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(8)]).repeat(T // 8 + 1, 1)[:T]
    topk_lp = torch.full((T, K), float(torch.tensor(0.9 / K).log()))
    behavior = BehaviorTopK(token_ids, torch.full((T,), -3.0), topk_ids, topk_lp)
    g.manual_seed(seed + 1 + rank)
    logits = (2 * torch.randn(T, width, generator=g)).to(torch.bfloat16)
    return logits, behavior


def _ours(logits, behavior, group):
    from megatron_pdm.vocab_parallel import policy_statistics

    s = policy_statistics(logits, behavior, "topk_kl", tail="aggregated", group=group)
    mask = (s.divergence <= 0.15) | (s.predicted_change <= 0)
    (-(mask * s.logprobs).sum()).backward()


def _megatron(logits, behavior, group):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    vocab_parallel_cross_entropy(logits, behavior.token_ids).sum().backward()


def _gather(logits, behavior, group):
    import torch.distributed as dist

    world = dist.get_world_size(group)
    parts = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(parts, logits.detach(), group=group)
    full = torch.cat(parts, dim=-1).requires_grad_(True)
    del parts
    logp = torch.log_softmax(full.float(), dim=-1)
    logp_k = logp.gather(1, behavior.token_ids[:, None]).squeeze(-1)
    with torch.no_grad():
        pi = logp.exp()
        pi_top = pi.gather(1, behavior.topk_ids)
        mu_top, mu_k, pi_k = behavior.topk_logprobs.exp(), behavior.token_logprobs.exp(), logp_k.exp()
        mu_t, pi_t = (1 - mu_top.sum(-1)).clamp_min(0), (1 - pi_top.sum(-1)).clamp_min(1e-12)
        d = (mu_top * (mu_top.log() - pi_top.log())).sum(-1) + mu_t * (mu_t.log() - pi_t.log())
        ddot = (pi_k - mu_k) + (pi_top * (mu_top - pi_top)).sum(-1) + pi_t * (mu_t - pi_t)
        mask = (d <= 0.15) | (ddot <= 0)
        del pi
    (-(mask * logp_k).sum()).backward()
    width = logits.shape[1]
    rank = dist.get_rank(group)
    if logits.grad is None:
        logits.grad = full.grad[:, rank * width : (rank + 1) * width].contiguous()


def _worker(rank, world, port, variant, T, width, K, reps, queue):
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron_pdm.models import ParallelConfig, initialize_parallel

    ctx = initialize_parallel(ParallelConfig(tensor=world))
    group, gather_group = ctx.tp_group, ctx.groups.tp
    fn = {"ours": lambda lg, b: _ours(lg, b, group), "megatron": lambda lg, b: _megatron(lg, b, group),
          "gather": lambda lg, b: _gather(lg, b, gather_group)}[variant]
    base_logits, behavior = _inputs(T, width, K, rank, world)
    counter = {"bytes": 0, "calls": 0}
    _count_collectives(counter)

    def once():
        logits = base_logits.detach().requires_grad_(True)
        fn(logits, behavior)
        assert logits.grad is not None and logits.grad.shape == logits.shape
        return logits

    dist.barrier()
    _reset_peak_rss()
    base = _rss_kib("VmRSS")
    counter.update(bytes=0, calls=0)
    out = once()
    peak_mib = (_rss_kib("VmHWM") - base) / 1024
    comm = dict(counter)
    del out
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    queue.put({"rank": rank, "peak_mib": peak_mib, "times": times, "comm_bytes": comm["bytes"],
               "comm_calls": comm["calls"]})
    dist.destroy_process_group()


def skipped(variant, T, V, tp, K) -> dict:
    return {"variant": variant, "tokens": T, "vocab": V, "tp": tp, "k": K, "time_s": None, "times_s": [],
            "peak_mib": None, "comm_bytes_per_rank": None, "comm_calls_per_rank": None,
            "skipped": "tp copies of the full logits exceed the available memory"}


def memory_case(variant, T, V, tp, K) -> dict:
    """Memory in its own processes (glibc mmap threshold fixed); time in others (`timing_case`: allocator defaults,
    as the fixed threshold makes every allocation a fresh mmap and would slow chunked code that allocates per
    chunk)."""
    return _spawn(variant, T, V, tp, K, 0, fixed_mmap=True)


def timing_case(variant, T, V, tp, K, reps) -> dict:
    return _spawn(variant, T, V, tp, K, reps, fixed_mmap=False)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def spawn_setup(*, fixed_mmap: bool):
    """(spawn context, its queue, a free local port) for fresh worker processes; fixed_mmap: glibc's mmap threshold
    fixed at 64 KiB in them (the memory runs), else the allocator's defaults (the timing runs)."""
    if fixed_mmap:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc when the spawned workers start
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return ctx, ctx.Queue(), s.getsockname()[1]


def _spawn(variant, T, V, tp, K, reps, *, fixed_mmap):
    ctx, queue, port = spawn_setup(fixed_mmap=fixed_mmap)
    procs = [ctx.Process(target=_worker, args=(r, tp, port, variant, T, V // tp, K, reps, queue)) for r in range(tp)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"{variant} V={V} tp={tp}: worker exited with {p.exitcode}")
    per_rep = [max(r["times"][i] for r in results) for i in range(reps)]
    return {
        "variant": variant, "tokens": T, "vocab": V, "tp": tp, "k": K,
        "time_s": statistics.median(per_rep) if per_rep else float("nan"), "times_s": per_rep,
        "peak_mib": max(r["peak_mib"] for r in results),
        "comm_bytes_per_rank": max(r["comm_bytes"] for r in results),
        "comm_calls_per_rank": max(r["comm_calls"] for r in results),
    }


def _burn(ready, stop, size):
    """One background-load process: one-thread float32 matrix products until `stop` is set."""
    torch.set_num_threads(1)
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0)) / size**0.5
    b = torch.empty_like(a)
    torch.mm(a, a, out=b)
    ready.release()
    while not stop.is_set():
        torch.mm(a, a, out=b)


@contextlib.contextmanager
def background_load(n: int):
    """n processes of `_burn` on the machine's cores while the block runs; each has made a product before the block
    starts, and all are stopped and joined when it ends (n = 0: nothing)."""
    if n == 0:
        yield
        return
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Semaphore(0), ctx.Event()
    procs = [ctx.Process(target=_burn, args=(ready, stop, LOAD_MATRIX), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            if not ready.acquire(timeout=300):
                raise RuntimeError("the background load did not start within 300 s")
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
                p.join()


def _fmt(x, spec, width):
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{spec}}"


def _band(spread: dict | None) -> str:
    return "-" if spread is None else f"[{spread['min']:.2f}-{spread['max']:.2f}]"


def _ratio(a, b):
    return None if a is None or b is None else a / max(b, 1e-9)


def _rotated(items: list, r: int) -> list:
    return items[r % len(items):] + items[: r % len(items)]


def _per_round(num: list[float], den: list[float]) -> list[float]:
    return [a / b for a, b in zip(num, den, strict=False)]


def _loaded_summary(times: dict, v: str) -> dict:
    """A variant's time under load (median, spread) and its slowdown: the median of per-round loaded / quiet."""
    loaded = times["loaded"].get(v, [])
    slowdown = _per_round(loaded, times["quiet"].get(v, []))
    return {"time_s": statistics.median(loaded) if loaded else None, "rounds_s": loaded,
            "time_spread_s": _spread(loaded), "slowdown": statistics.median(slowdown) if slowdown else None,
            "slowdown_spread": _spread(slowdown)}


def main(argv=None):
    cpus = os.cpu_count() or 1
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load", type=int, default=(cpus + 1) // 2,
                    help="busy background processes in the loaded half of each round (0: quiet rounds only)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "vocab_parallel.json")
    args = ap.parse_args(argv)
    if args.load < 0:
        raise SystemExit(f"--load {args.load}: must be >= 0")
    variants = [v for v in VARIANTS if v in args.variants]
    T, K = args.tokens, args.k
    keys = [(V, tp) for V in args.vocab for tp in args.tp]
    for V, tp in keys:
        if V % tp:
            raise SystemExit(f"--vocab {V} is not divisible by --tp {tp}")
    threads = {tp: max(1, cpus // tp) for tp in args.tp}
    host = host_info(threads)
    burners = f"{args.load} busy one-thread process{'es' if args.load > 1 else ''}"
    print(host_line(host) + (f"; loaded rounds: {burners}" if args.load else ""), flush=True)
    cases = {key: {v: (memory_case(v, T, *key, K) if _fits(v, T, *key) else skipped(v, T, *key, K))
                   for v in variants} for key in keys}
    modes = ["quiet", "loaded"] if args.load else ["quiet"]
    rounds = {key: {mode: {v: [] for v in variants} for mode in modes} for key in keys}  # per-round medians
    for r in range(args.rounds):
        for mode in _rotated(modes, r):  # quiet first in even rounds, loaded first in odd ones
            with background_load(args.load if mode == "loaded" else 0):
                for key in keys:
                    order = _rotated(variants, r)  # no variant in a fixed position
                    for v in order:
                        if cases[key][v].get("skipped"):
                            continue
                        t = timing_case(v, T, *key, K, args.reps)
                        rounds[key][mode][v].append(t["time_s"])
                        if mode == "quiet":
                            cases[key][v] = t | {"peak_mib": cases[key][v]["peak_mib"]}
                    print(f"round {r + 1}/{args.rounds} {mode} T={T} V={key[0]} tp={key[1]}: " + ", ".join(
                        f"{v} {rounds[key][mode][v][-1]:.3f}s" for v in order if rounds[key][mode][v]), flush=True)
    for key in keys:
        for v in variants:
            quiet = rounds[key]["quiet"][v]
            if quiet:
                cases[key][v].update(time_s=statistics.median(quiet), rounds_s=quiet, time_spread_s=_spread(quiet))
                if args.load:
                    cases[key][v]["loaded"] = _loaded_summary(rounds[key], v)
    rows = [c for case in cases.values() for c in case.values()]
    get = lambda case, v, key: case[v][key] if v in case else None  # noqa: E731
    header = (f"{'V':>7} {'tp':>3} | {'ours s':>7} {'mcore s':>7} {'gather s':>8} | {'ours/mcore [spread]':>19} "
              f"{'gather/mcore':>12} | {'ours MiB':>8} {'mcore MiB':>9} {'gather MiB':>10} {'gather/ours':>11} | "
              f"{'ours comm B':>11} {'calls':>5} {'B/(T*K)':>7} {'mcore B':>8} {'gather B':>11}")
    print("\n" + header + "\n" + "-" * len(header))
    summary = []
    for (V, tp), case in cases.items():
        t = {v: get(case, v, "time_s") for v in VARIANTS}
        mem = {v: get(case, v, "peak_mib") for v in VARIANTS}
        comm = {v: get(case, v, "comm_bytes_per_rank") for v in VARIANTS}
        tp1 = cases.get((V, 1), {})
        times = rounds[V, tp]
        per_round = _per_round(times["quiet"].get("ours", []), times["quiet"].get("megatron", []))
        r = {
            "vocab": V, "tp": tp,
            # the median over rounds of the per-round ratio, with its spread (a ratio of medians hides it)
            "time_ratio_ours_to_megatron": statistics.median(per_round) if per_round else None,
            "time_ratio_ours_to_megatron_spread": _spread(per_round),
            "time_ratio_gather_to_megatron": _ratio(t["gather"], t["megatron"]),
            "memory_ratio_gather_to_ours": _ratio(mem["gather"], mem["ours"]),
            "memory_ratio_ours_to_megatron": _ratio(mem["ours"], mem["megatron"]),
            "ours_comm_bytes_per_token_k": _ratio(comm["ours"], args.tokens * args.k),
            "ours_comm_calls_per_rank": get(case, "ours", "comm_calls_per_rank"),
        }
        r.update({f"time_ratio_{v}_to_tp1": _ratio(t[v], get(tp1, v, "time_s")) for v in VARIANTS})
        if args.load:
            loaded = _per_round(times["loaded"].get("ours", []), times["loaded"].get("megatron", []))
            r.update(loaded_time_ratio_ours_to_megatron=statistics.median(loaded) if loaded else None,
                     loaded_time_ratio_ours_to_megatron_spread=_spread(loaded))
            for v in variants:
                got = _loaded_summary(times, v)
                r.update({f"load_slowdown_{v}": got["slowdown"], f"load_slowdown_{v}_spread": got["slowdown_spread"]})
        summary.append(r)
        print(f"{V:>7} {tp:>3} | {_fmt(t['ours'], '.3f', 7)} {_fmt(t['megatron'], '.3f', 7)} "
              f"{_fmt(t['gather'], '.3f', 8)} | {_fmt(r['time_ratio_ours_to_megatron'], '.2f', 5)} "
              f"{_band(r['time_ratio_ours_to_megatron_spread']):>13} "
              f"{_fmt(r['time_ratio_gather_to_megatron'], '.2f', 12)} | {_fmt(mem['ours'], '.0f', 8)} "
              f"{_fmt(mem['megatron'], '.0f', 9)} {_fmt(mem['gather'], '.0f', 10)} "
              f"{_fmt(r['memory_ratio_gather_to_ours'], '.2f', 11)} | {_fmt(comm['ours'], 'd', 11)} "
              f"{_fmt(r['ours_comm_calls_per_rank'], 'd', 5)} {_fmt(r['ours_comm_bytes_per_token_k'], '.2f', 7)} "
              f"{_fmt(comm['megatron'], 'd', 8)} {_fmt(comm['gather'], 'd', 11)}")
    header = f"{'V':>7} {'tp':>3} | " + " ".join(f"{v + ' s':>10} {v + '/tp1':>13}" for v in VARIANTS)
    print("\nTP scaling (time at tp / time at tp=1; tp above the core count time-shares the cores)\n" + header
          + "\n" + "-" * len(header))
    for r in summary:
        case = cases[r["vocab"], r["tp"]]
        print(f"{r['vocab']:>7} {r['tp']:>3} | " + " ".join(
            f"{_fmt(get(case, v, 'time_s'), '.3f', 10)} {_fmt(r[f'time_ratio_{v}_to_tp1'], '.2f', 13)}"
            for v in VARIANTS))
    if args.load:
        bound = (cpus + args.load) / cpus
        header = (f"{'V':>7} {'tp':>3} | " + " ".join(f"{v + ' s':>10}" for v in VARIANTS)
                  + f" | {'ours/mcore [spread]':>19} | "
                  + " ".join(f"{v + ' load/quiet [spread]':>27}" for v in VARIANTS))
        print(f"\nUnder load ({burners} on {cpus} cpus; a process using every core slows "
              f"{bound:.2f}x at best): times, ratio, slowdown = median of per-round loaded / quiet\n"
              + header + "\n" + "-" * len(header))
        for r in summary:
            case = cases[r["vocab"], r["tp"]]
            lt = {v: (case[v].get("loaded") or {}).get("time_s") if v in case else None for v in VARIANTS}
            print(f"{r['vocab']:>7} {r['tp']:>3} | " + " ".join(_fmt(lt[v], ".3f", 10) for v in VARIANTS)
                  + f" | {_fmt(r['loaded_time_ratio_ours_to_megatron'], '.2f', 5)} "
                  f"{_band(r['loaded_time_ratio_ours_to_megatron_spread']):>13} | " + " ".join(
                      f"{_fmt(r.get(f'load_slowdown_{v}'), '.2f', 13)} {_band(r.get(f'load_slowdown_{v}_spread')):>13}"
                      for v in VARIANTS))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"host": host, "tokens": args.tokens, "k": args.k, "reps": args.reps, "rounds": args.rounds,
            "dtype": "bfloat16", "threads_per_rank": threads, "load_processes": args.load,
            "load": f"one-thread float32 [{LOAD_MATRIX}, {LOAD_MATRIX}] matrix products" if args.load else None}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return summary

if __name__ == "__main__":
    main()
