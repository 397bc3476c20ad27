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
to (b) and writes JSON.

    python benchmarks/vocab_parallel.py [--tokens 4096] [--vocab 32768 151936] [--tp 1 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

VARIANTS = ("ours", "megatron", "gather")


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
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group() if world > 1 else None
    gather_group = parallel_state.get_tensor_model_parallel_group()
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


def run_case(variant, T, V, tp, K, reps):
    """Memory in one set of processes (glibc mmap threshold fixed), time in another (allocator defaults: the fixed
    threshold makes every allocation a fresh mmap and would slow chunked code that allocates per chunk)."""
    memory = _spawn(variant, T, V, tp, K, 0, fixed_mmap=True)
    timing = _spawn(variant, T, V, tp, K, reps, fixed_mmap=False)
    return timing | {"peak_mib": memory["peak_mib"]}


def _spawn(variant, T, V, tp, K, reps, *, fixed_mmap):
    if fixed_mmap:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc when the spawned workers start
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "vocab_parallel.json")
    args = ap.parse_args(argv)
    rows = []
    for V in args.vocab:
        for tp in args.tp:
            if V % tp:
                raise SystemExit(f"--vocab {V} is not divisible by --tp {tp}")
            case = {v: run_case(v, args.tokens, V, tp, args.k, args.reps) for v in VARIANTS}
            rows.extend(case.values())
            a, b, c = (case[v] for v in VARIANTS)
            print(f"T={args.tokens} V={V} tp={tp}: " + ", ".join(
                f"{v} {case[v]['time_s']:.3f}s {case[v]['peak_mib']:.0f}MiB" for v in VARIANTS), flush=True)
    header = (f"{'V':>7} {'tp':>3} | {'ours s':>7} {'mcore s':>7} {'gather s':>8} | {'ours/mcore':>10} "
              f"{'gather/mcore':>12} | {'ours MiB':>8} {'mcore MiB':>9} {'gather MiB':>10} {'gather/ours':>11} | "
              f"{'ours comm B':>11} {'B/(T*K)':>7} {'mcore B':>8} {'gather B':>11}")
    print("\n" + header + "\n" + "-" * len(header))
    summary = []
    for i in range(0, len(rows), 3):
        a, b, c = rows[i : i + 3]
        r = {
            "vocab": a["vocab"], "tp": a["tp"],
            "time_ratio_ours_to_megatron": a["time_s"] / b["time_s"],
            "time_ratio_gather_to_megatron": c["time_s"] / b["time_s"],
            "memory_ratio_gather_to_ours": c["peak_mib"] / max(a["peak_mib"], 1e-9),
            "memory_ratio_ours_to_megatron": a["peak_mib"] / max(b["peak_mib"], 1e-9),
            "ours_comm_bytes_per_token_k": a["comm_bytes_per_rank"] / (args.tokens * args.k),
        }
        summary.append(r)
        print(f"{a['vocab']:>7} {a['tp']:>3} | {a['time_s']:>7.3f} {b['time_s']:>7.3f} {c['time_s']:>8.3f} | "
              f"{r['time_ratio_ours_to_megatron']:>10.2f} {r['time_ratio_gather_to_megatron']:>12.2f} | "
              f"{a['peak_mib']:>8.0f} {b['peak_mib']:>9.0f} {c['peak_mib']:>10.0f} "
              f"{r['memory_ratio_gather_to_ours']:>11.2f} | {a['comm_bytes_per_rank']:>11} "
              f"{r['ours_comm_bytes_per_token_k']:>7.2f} {b['comm_bytes_per_rank']:>8} {c['comm_bytes_per_rank']:>11}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "python": sys.version.split()[0], "machine": platform.machine(),
            "cpus": os.cpu_count(), "tokens": args.tokens, "k": args.k, "reps": args.reps, "dtype": "bfloat16"}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return summary


if __name__ == "__main__":
    main()
