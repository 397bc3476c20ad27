"""Peak memory and time of the loss path (output layer GEMM + PDM loss + backward) with and without the fused
output layer, against megatron-core's vocab-parallel cross entropy on the same GEMM (issue 37's target).

  unfused:  z = hidden @ W^T (the output layer), objectives.policy_loss(z, top-K behavior), backward
  fused:    objectives.policy_loss_from_hidden(hidden, W, top-K behavior), backward (no [T, V/tp] tensor)
  megatron: z = hidden @ W^T, megatron.core.tensor_parallel.vocab_parallel_cross_entropy(z, k).mean(), backward

One process per (shape, variant), one TP rank (V/tp is the shard width a TP rank holds: 151,936 / 8 = 18,992 is
Qwen3's vocabulary at TP 8). float32 hidden states and weight (a CPU's fast GEMM dtype; the logits and their gradient
are what the fused path removes, in any dtype), PDM on the top-K KL (K = 20). As megatron's DDP does, the weight has
a float32 `main_grad` buffer into which its gradient goes (a hook adds .grad and frees it); the hidden states, the
weight and that buffer are allocated before the baseline, so the peak is what the loss path adds: the logits, their
gradient, the chunk buffers, the hidden states' gradient, the weight's gradient before it reaches main_grad.

Peak memory: the growth of the resident set over one call (VmHWM after `clear_refs` minus VmRSS before), glibc's
mmap threshold fixed at 64 KiB so that freed tensors leave the resident set (as in benchmarks/vocab_parallel.py).
Time: other processes with the allocator's defaults, `--rounds` rounds each running every variant once in a rotated
order; a variant's time is its median over rounds, each ratio the median of the per-round ratios.

    python benchmarks/fused_output.py [--shapes 16384x18992 4096x75968] [--hidden 4096] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from host import host_info, host_line
from vocab_parallel import _reset_peak_rss, _rss_kib, spawn_setup  # what both benchmarks measure with

VARIANTS = ("unfused", "fused", "megatron")


def _inputs(T, width, H, K, seed=0):
    """hidden [T, H], W [V_l, H] (logits of std ~2), a top-K behavior, advantages +-1 (seeded)."""
    from megatron_pdm.vocab_parallel import BehaviorTopK

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(width, H, generator=g) * (2.0 / H**0.5)
    token_ids = torch.randint(0, width, (T,), generator=g)
    topk_ids = torch.stack([torch.randperm(width, generator=g)[:K] for _ in range(8)]).repeat(T // 8 + 1, 1)[:T]
    behavior = BehaviorTopK(token_ids, torch.full((T,), -3.0), topk_ids,
                            torch.full((T, K), float(torch.tensor(0.9 / K).log())))
    advantages = torch.randint(0, 2, (T,), generator=g).float() * 2 - 1
    return hidden, weight, behavior, advantages


def _worker(variant, T, width, H, K, reps, port, queue):
    import torch.distributed as dist

    torch.set_num_threads(os.cpu_count() or 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron_pdm.models import ParallelConfig, initialize_parallel
    from megatron_pdm.objectives import ObjectiveConfig, policy_loss, policy_loss_from_hidden

    initialize_parallel(ParallelConfig())  # megatron's cross entropy reads its global TP group
    hidden, w, behavior, A = _inputs(T, width, H, K)
    w.requires_grad_(True)
    w.main_grad = torch.zeros_like(w)  # megatron DDP's float32 gradient buffer

    def to_main_grad(p):  # DDP's hook: .grad (if any: the fused path adds to main_grad itself) into main_grad, freed
        if p.grad is not None:
            p.main_grad.add_(p.grad)
        p.grad = None

    w.register_post_accumulate_grad_hook(to_main_grad)
    mask, config = torch.ones(T), ObjectiveConfig()

    def once():
        x = hidden.detach().requires_grad_(True)
        if variant == "fused":
            loss = policy_loss_from_hidden(x, w, behavior, A, mask, config, temperature=1.0, normalizer=T).loss
        elif variant == "unfused":
            loss = policy_loss(x @ w.t(), behavior, A, mask, config, temperature=1.0, normalizer=T).loss
        else:
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

            loss = vocab_parallel_cross_entropy(x @ w.t(), behavior.token_ids).mean()
        loss.backward()
        assert x.grad is not None and w.grad is None
        return x.grad

    times = []
    if reps == 0:  # the memory run
        _reset_peak_rss()
        base = _rss_kib("VmRSS")
        once()
        peak_mib = (_rss_kib("VmHWM") - base) / 1024
    else:
        peak_mib = None
        for _ in range(reps):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
    queue.put({"peak_mib": peak_mib, "times": times})
    dist.destroy_process_group()


def _spawn(variant, T, width, H, K, reps) -> dict:
    ctx, queue, port = spawn_setup(fixed_mmap=reps == 0)
    p = ctx.Process(target=_worker, args=(variant, T, width, H, K, reps, port, queue))
    p.start()
    while True:  # a worker that dies never answers: its exit code is the error
        try:
            out = queue.get(timeout=5)
            break
        except Exception:
            if not p.is_alive():
                raise RuntimeError(f"{variant} T={T} V/tp={width}: worker exited with {p.exitcode}") from None
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"{variant} T={T} V/tp={width}: worker exited with {p.exitcode}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["16384x18992", "4096x75968"], help="TOKENSxVOCAB_SHARD")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", default="benchmarks/results/fused_output.json")
    args = ap.parse_args(argv)
    host = host_info(os.cpu_count() or 1)  # each worker runs on every core
    print(host_line(host), flush=True)
    rows = []
    for shape in args.shapes:
        T, width = (int(v) for v in shape.split("x"))
        case = {v: {"peak_mib": _spawn(v, T, width, args.hidden, args.k, 0)["peak_mib"], "times_s": []}
                for v in args.variants}
        ratios = {v: [] for v in args.variants}
        for r in range(args.rounds):
            order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
            got = {v: _spawn(v, T, width, args.hidden, args.k, 1)["times"][0] for v in order}
            for v in args.variants:
                case[v]["times_s"].append(got[v])
                ratios[v].append(got[v] / got["unfused"] if "unfused" in got else float("nan"))
        for v in args.variants:
            t = case[v]["times_s"]
            rows.append({"tokens": T, "vocab_shard": width, "hidden": args.hidden, "k": args.k, "variant": v,
                         "peak_mib": case[v]["peak_mib"], "time_s": statistics.median(t) if t else None,
                         "times_s": t, "time_vs_unfused": statistics.median(ratios[v]) if t else None,
                         "memory_vs_unfused": case[v]["peak_mib"] / case["unfused"]["peak_mib"]
                         if "unfused" in case else None})
    print(f"{'T':>6} {'V/tp':>7} {'variant':>9} {'peak MiB':>9} {'x less':>7} {'time s':>7} {'time/unfused':>13}")
    for r in rows:
        less = 1 / r["memory_vs_unfused"] if r["memory_vs_unfused"] else float("nan")
        t, tr = (f"{x:.2f}" if x is not None else "-" for x in (r["time_s"], r["time_vs_unfused"]))
        print(f"{r['tokens']:>6} {r['vocab_shard']:>7} {r['variant']:>9} {r['peak_mib']:>9.0f} {less:>7.2f} "
              f"{t:>7} {tr:>13}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "argv": sys.argv[1:], "host": host}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
