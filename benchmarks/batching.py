"""Micro-batching long-tailed RL responses: fixed-size micro-batches against token budgets, one run.

Responses follow the shape of real RL lengths (lognormal, median 1K, maximum 16K tokens: the 30B setting of
the DPPO paper), scaled down by `--scale` to CPU sizes (median 1K/32 = 32, maximum 512), behind prompts of 16-64
tokens. Three ways to cut one minibatch of them into micro-batches, each a forward + backward of a megatron-core
GPT (local layer spec, one rank) with the token cross-entropy:

- fixed, global pad: `micro_batch_size` rows, every row padded to the longest of the whole minibatch (what the
  trainer did before token budgets);
- fixed, own pad: the same rows, each micro-batch padded to its own longest;
- token budget: sequences sorted by length and packed in that order while rows x longest stays under
  `max_tokens_per_microbatch`, set to micro_batch_size x the longest sequence, so that no micro-batch computes
  more positions than a fixed one (the same peak memory); each padded to its own longest.

Columns: positions computed (rows x padded width, summed), padding fraction, forward + backward seconds per real
token, and peak resident memory over the pass (each variant in a process of its own, after a warm-up pass). Times
and memory are medians over `--rounds` interleaved rounds (every variant once per round, in a rotated order), with
the spread [min-max]. The JSON names the host (benchmarks/host.py).

    python benchmarks/batching.py [--sequences 256] [--rounds 3] [--out benchmarks/results/batching.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("fixed_global_pad", "fixed_own_pad", "token_budget")


def lengths(n: int, *, scale: int, seed: int) -> tuple[list[int], list[int]]:
    """(prompt lengths, response lengths): responses lognormal with median 1024/scale, clipped to 16384/scale."""
    import torch

    g = torch.Generator().manual_seed(seed)
    median, top = 1024 // scale, 16384 // scale
    resp = (torch.randn(n, generator=g) * 1.0 + torch.log(torch.tensor(float(median)))).exp()
    resp = resp.round().clamp(1, top).long().tolist()
    prompts = torch.randint(16, 65, (n,), generator=g).tolist()
    return prompts, resp


def micro_batches(variant: str, prompts, resp, *, micro_batch_size: int):
    """[(rows, padded width)] per micro-batch, and the real tokens, for a variant."""
    from megatron_pdm.train.batch import pack_by_tokens

    total = [p + r for p, r in zip(prompts, resp, strict=True)]
    if variant == "token_budget":
        bins = pack_by_tokens(total, micro_batch_size * max(total))
    else:
        bins = [list(range(i, min(i + micro_batch_size, len(total)))) for i in range(0, len(total), micro_batch_size)]
    width = max(total)
    return [(b, width if variant == "fixed_global_pad" else max(total[i] for i in b)) for b in bins], sum(total)


def run_variant(variant: str, args, queue) -> None:
    import torch
    import torch.distributed as dist

    from megatron_pdm.models import ModelConfig, ParallelConfig, build_model, forward_logits, initialize_parallel
    from megatron_pdm.train.launch import quiet_known_warnings

    quiet_known_warnings()
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=0, world_size=1)
    ctx = initialize_parallel(ParallelConfig(), seed=0)
    cfg = ModelConfig(vocab_size=1024, hidden_size=args.hidden, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, head_dim=args.hidden // 4, ffn_hidden_size=3 * args.hidden,
                      max_position_embeddings=1024)
    model = build_model(cfg, ctx)
    prompts, resp = lengths(args.sequences, scale=args.scale, seed=args.seed)
    plan, real = micro_batches(variant, prompts, resp, micro_batch_size=args.micro_batch_size)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (args.sequences, max(p + r for p, r in zip(prompts, resp, strict=True))),
                        generator=g)

    def one_pass():
        for rows, width in plan:
            x = ids[rows, :width]
            logits = forward_logits(model, x)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                     x[:, 1:].reshape(-1))
            loss.backward()

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    one_pass()  # warm-up: allocator and kernels
    peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    t0 = time.perf_counter()
    one_pass()
    seconds = time.perf_counter() - t0
    positions = sum(len(rows) * width for rows, width in plan)
    queue.put(dict(variant=variant, micro_batches=len(plan), positions=positions, real_tokens=real,
                   padding_frac=1 - real / positions, seconds=seconds, us_per_real_token=1e6 * seconds / real,
                   peak_rss_growth_mib=peak_mib, max_positions_per_micro_batch=max(len(r) * w for r, w in plan)))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--scale", type=int, default=32, help="lengths divided by this (median 1K / scale)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/batching.json")
    args = ap.parse_args()
    from megatron_pdm.train.launch import _free_port

    runs = {v: [] for v in VARIANTS}
    ctx = mp.get_context("spawn")
    for r in range(args.rounds):  # interleaved: every variant once per round, in a rotated order
        for variant in VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]:
            args.port = _free_port()  # one process each: peak memory is per process
            q = ctx.Queue()
            p = ctx.Process(target=run_variant, args=(variant, args, q))
            p.start()
            runs[variant].append(q.get(timeout=1800))
            p.join()
    rows = []
    for got in runs.values():  # counts are the same every round; times and memory: medians, with spread
        row = dict(got[0])
        for key in ("seconds", "us_per_real_token", "peak_rss_growth_mib"):
            values = [g[key] for g in got]
            row.update({key: statistics.median(values), f"{key}_min": min(values), f"{key}_max": max(values)})
        rows.append(row)
    base = rows[0]
    print(f"{args.sequences} responses, lognormal lengths median {1024 // args.scale} max {16384 // args.scale} "
          f"(1K / 16K scaled by 1/{args.scale}), prompts 16-64, micro_batch_size {args.micro_batch_size}")
    print("| variant | micro-batches | positions | padding | us / real token | peak RSS growth | positions vs "
          "fixed, global pad |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['micro_batches']} | {r['positions']:,} | {r['padding_frac']:.1%} | "
              f"{r['us_per_real_token']:.1f} [{r['us_per_real_token_min']:.1f}-{r['us_per_real_token_max']:.1f}] | "
              f"{r['peak_rss_growth_mib']:.0f} MiB | "
              f"{base['positions'] / r['positions']:.2f}x fewer |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    import torch
    from host import host_info

    Path(args.out).write_text(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "port"},
                                          "host": host_info(torch.get_num_threads()),  # the workers' default
                                          "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
