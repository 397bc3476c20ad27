"""GPU check and timings of the fused Triton kernels for the vocab-parallel statistics (one GPU, TP = 1).

1. Correctness: on random bf16 logits (fixed seed, SEED), `policy_statistics` (every top-K and exact kind) and the
   log pi(k) gradient with the fused kernels against the torch path (same inputs, same GPU) and against a float64
   CPU reference on a small slice. Fails (exit 1) on a mismatch. The TV kinds' Ddot weighs each category by
   sign(pi_c - mu_c), which flips on rounding noise where pi_c ~ mu_c: their Ddot may differ by the flips' effect
   (tests/reference.py `tv_sign_slack`, the sum of |pidot_c| over near-tied categories) on top of the tolerance.
2. Timings with CUDA events (median of --reps after --warmup) for T in {8192, 65536}, V/tp in {18992, 151936},
   bf16: forward (topk_kl, K = 20: log pi(k), entropy, D, Ddot) and forward + backward of
     torch     our torch path (kernels off)
     fused     our Triton path
     mcore     megatron-core's fused_vocab_parallel_cross_entropy (log pi(k) only, for scale)
   and the bytes-read floor: the logits shard's bytes over the copy bandwidth measured here (one read forward;
   forward + backward: two reads and one write).

    python benchmarks/gpu_vocab_parallel.py [--out benchmarks/results/gpu_vocab_parallel.json]
    TRITON_INTERPRET=1 python benchmarks/gpu_vocab_parallel.py --smoke --out /tmp/x.json   # the script on a CPU

Prints a table, writes JSON. About 2 minutes on an H100 / H200.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from host import host_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_pdm.vocab_parallel import (  # noqa: E402
    EXACT_KINDS,
    TOPK_KINDS,
    BehaviorLogits,
    BehaviorTopK,
    kernels,
    policy_statistics,
    token_logprobs,
)
from tests.reference import tv_sign_slack  # noqa: E402

K = 20
SEED = 0  # the checks' inputs: a fixed seed, so that a run is reproducible
TOL = 1e-4
SHAPES = [(8192, 18992), (8192, 151936), (65536, 18992), (65536, 151936)]


def _topk_behavior(T, V, device, g, rows=4096):
    """bf16 logits z [T, V], mu's bf16 logits b = z + noise, and mu's top-K view with k ~ mu; built in row chunks
    so that the largest shape (20 GB of bf16) needs no float32 copy of itself."""
    z = torch.empty(T, V, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(z)
    parts = []
    for r in range(0, T, rows):
        zc = torch.randn(min(rows, T - r), V, device=device, generator=g) * 2
        bc = zc + 0.3 * torch.randn(zc.shape, device=device, generator=g)
        z[r : r + rows], b[r : r + rows] = zc, bc
        log_mu = torch.log_softmax(b[r : r + rows].float(), -1)
        top_lp, top_ids = log_mu.topk(K, -1)
        k = torch.multinomial(log_mu.exp(), 1, generator=g).squeeze(-1)
        parts.append((k, log_mu.gather(1, k[:, None]).squeeze(-1), top_ids, top_lp))
    return z, b, BehaviorTopK(*(torch.cat(t) for t in zip(*parts, strict=True)))


class _Fused:
    """Turn the kernels on or off for a block (the library decides by `kernels.fused_available`); --smoke turns
    them on for CPU tensors too (Triton's interpreter runs them)."""

    force_on_cpu = False

    def __init__(self, on: bool):
        self.on, self.original = on, kernels.fused_available

    def __enter__(self):
        if not self.on:
            kernels.fused_available = lambda logits: False
        elif self.force_on_cpu:
            kernels.fused_available = lambda logits: logits.dtype in kernels.DTYPES

    def __exit__(self, *exc):
        kernels.fused_available = self.original


def _stats(z, beh, kind, T=1.0):
    return policy_statistics(z, beh, kind, temperature=T)


def check_correctness(device, T=512, V=151936) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(SEED)
    rows = []
    z, b, beh = _topk_behavior(T, V, device, g)
    exact = BehaviorLogits(beh.token_ids, b)
    for kind in TOPK_KINDS + EXACT_KINDS:
        behavior = exact if kind in EXACT_KINDS else beh
        with torch.no_grad(), _Fused(False):
            ref = _stats(z, behavior, kind, 0.9)
        with torch.no_grad(), _Fused(True):
            got = _stats(z, behavior, kind, 0.9)
        err = max(float((a.double() - r.double()).abs().max()) for a, r in zip(got, ref, strict=True))
        # Ddot of the TV kinds: the excess over TOL must be explained by sign flips of near-tied categories
        slack = tv_sign_slack(z, beh, kind, temperature=0.9, behavior_logits=b)
        excess = float(((got.predicted_change.double() - ref.predicted_change.double()).abs() - slack).max())
        others = max(float((a.double() - r.double()).abs().max()) for a, r in zip(got[:4], ref[:4], strict=True))
        rows.append({"check": f"stats {kind} vs torch path", "max_abs_err": err, "max_sign_slack": float(slack.max()),
                     "ok": others < TOL and excess < TOL})
    # float64 CPU reference on a slice: D, Ddot of topk_kl
    sl = slice(0, 32)
    zc = z[sl].double().cpu()
    small = BehaviorTopK(*(t[sl].cpu() for t in (beh.token_ids, beh.token_logprobs, beh.topk_ids, beh.topk_logprobs)))
    ref64 = policy_statistics(zc, small, "topk_kl")
    with torch.no_grad(), _Fused(True):
        got = _stats(z[sl].contiguous(), BehaviorTopK(beh.token_ids[sl], beh.token_logprobs[sl], beh.topk_ids[sl],
                                                      beh.topk_logprobs[sl]), "topk_kl")
    err = max(float((a.double().cpu() - r).abs().max()) for a, r in zip(got, ref64, strict=True))
    rows.append({"check": "stats topk_kl vs float64 CPU", "max_abs_err": err, "ok": err < TOL})
    # gradient of sum_t w_t log pi_t(k_t)
    w = torch.randn(T, device=device, generator=g)
    grads = []
    for on in (False, True):
        leaf = z.detach().clone().requires_grad_(True)
        with _Fused(on):
            (w * token_logprobs(leaf, beh.token_ids, temperature=0.9)).sum().backward()
        grads.append(leaf.grad.float())
    err = float((grads[0] - grads[1]).abs().max())
    # both are rounded to bf16 (8 bits): one unit in the last place of the largest entry is the tolerance
    rows.append({"check": "log pi(k) gradient vs torch path (bf16 out)", "max_abs_err": err,
                 "ok": err <= 2**-7 * float(grads[0].abs().max())})
    return rows


def _time(fn, warmup, reps) -> float:
    """Median milliseconds of fn() (CUDA events; wall clock on a CPU, for --smoke)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth(device, nbytes=2**32) -> float:
    """Bytes per second of one read plus one write of an `nbytes` buffer, halved: the read bandwidth a one-pass
    kernel can reach."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), 3, 20)
    return 2 * nbytes / (ms / 1e3)


def _time_case(z, beh, warmup, reps, mcore_ce) -> dict:
    row = {}

    def fwd():
        with torch.no_grad():
            _stats(z, beh, "topk_kl")

    def fwd_bwd():
        leaf = z.detach().requires_grad_(True)
        _stats(leaf, beh, "topk_kl").logprobs.sum().backward()

    for name, on in (("torch", False), ("fused", True)):
        with _Fused(on):
            row[f"{name}_fwd_ms"] = _time(fwd, warmup, reps)
            row[f"{name}_fwd_bwd_ms"] = _time(fwd_bwd, warmup, reps)
    if mcore_ce is None:
        return row
    zz, target = z.view(z.shape[0], 1, z.shape[1]), beh.token_ids.view(-1, 1)

    def ce_fwd():
        with torch.no_grad():
            mcore_ce(zz, target)

    def ce_fwd_bwd():
        mcore_ce(zz.detach().requires_grad_(True), target).sum().backward()

    try:  # it keeps fp32 copies of the whole shard: the largest shapes may not fit
        row["mcore_fwd_ms"] = _time(ce_fwd, warmup, reps)
        row["mcore_fwd_bwd_ms"] = _time(ce_fwd_bwd, warmup, reps)
    except torch.cuda.OutOfMemoryError:
        row["mcore"] = "out of memory"
    return row


def time_shapes(device, shapes, warmup, reps, mcore_ce) -> tuple[list[dict], float]:
    bw = copy_bandwidth(device, 2**32 if device.type == "cuda" else 2**26)
    torch.cuda.empty_cache()
    rows = []
    g = torch.Generator(device=device).manual_seed(1)
    for T, V in shapes:
        z, _, beh = _topk_behavior(T, V, device, g)
        shard_bytes = z.numel() * z.element_size()
        row = {"T": T, "V_local": V, "floor_fwd_ms": 1e3 * shard_bytes / bw, "floor_fwd_bwd_ms": 3e3 * shard_bytes / bw}
        row.update(_time_case(z, beh, warmup, reps, mcore_ce))
        rows.append(row)
        print(_format_row(row), flush=True)
        torch.cuda.empty_cache()
    return rows, bw


HEAD = (f"{'T':>6} {'V/tp':>7} | {'torch fwd':>9} {'fused fwd':>9} {'mcore fwd':>9} {'floor':>7} | "
        f"{'torch f+b':>9} {'fused f+b':>9} {'mcore f+b':>9} {'floor':>7} | {'fused/floor f+b':>15}  (ms)")


def _format_row(r) -> str:
    f = lambda k: f"{r[k]:9.2f}" if k in r else f"{'-':>9}"  # noqa: E731
    return (f"{r['T']:>6} {r['V_local']:>7} | {f('torch_fwd_ms')} {f('fused_fwd_ms')} {f('mcore_fwd_ms')} "
            f"{r['floor_fwd_ms']:7.2f} | {f('torch_fwd_bwd_ms')} {f('fused_fwd_bwd_ms')} {f('mcore_fwd_bwd_ms')} "
            f"{r['floor_fwd_bwd_ms']:7.2f} | {r['fused_fwd_bwd_ms'] / r['floor_fwd_bwd_ms']:15.2f}")


def _mcore_cross_entropy():
    """megatron-core's fused vocab-parallel cross entropy over a one-rank group, or None when unavailable."""
    try:
        import torch.distributed as dist
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    except ImportError as e:
        print(f"megatron-core fused cross entropy unavailable: {e}")
        return None
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    group = dist.new_group([0])
    return lambda logits, target: fused_vocab_parallel_cross_entropy(logits, target, group)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gpu_vocab_parallel.json")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU under TRITON_INTERPRET=1: checks the script, not the kernels' speed")
    args = ap.parse_args()
    if not kernels.triton_available() or not (torch.cuda.is_available() or args.smoke):
        print("needs CUDA and Triton (or --smoke with Triton, TRITON_INTERPRET=1)")
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SHAPES
    if args.smoke:
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke on a CPU needs TRITON_INTERPRET=1")
            return 2
        _Fused.force_on_cpu = device.type == "cpu"
        shapes = [(8, 1100), (16, 2100)]  # two and three column blocks; few rows: Triton's interpreter is slow
    t0 = time.perf_counter()
    checks = check_correctness(device, *((32, 1500) if args.smoke else ()))  # 32 rows: the float64 slice's
    for c in checks:
        print(f"{'ok ' if c['ok'] else 'BAD'} {c['check']:<48} max |err| {c['max_abs_err']:.2e}")
    print(HEAD)
    rows, bw = time_shapes(device, shapes, args.warmup, args.reps, _mcore_cross_entropy())
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
           "torch": torch.__version__, "python": platform.python_version(),
           "host": host_info(torch.get_num_threads()),  # the CPU beside the GPU (and the --smoke figures')
           "copy_read_bandwidth_gb_s": bw / 1e9, "checks": checks, "timings": rows,
           "seconds": time.perf_counter() - t0}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"read bandwidth {bw / 1e9:.0f} GB/s; wrote {args.out} ({out['seconds']:.0f} s)")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
