"""bf16 / fp16 on a CPU without native low-precision GEMMs: torch's own products against compat patch 11's emulation.

Two measurements, each case in a fresh process (oneDNN reads ONEDNN_MAX_CPU_ISA once, at its first use):

- GEMM: GFLOP/s of `F.linear` and of `mm` at [512, 576] x [576, 1536] (a SmolLM2 MLP projection over 512 tokens)
  in float32, and in bf16 / fp16 natively (torch's product) and emulated (`lowp_gemm_scope`: float32 on the exact
  low-precision inputs, rounded once); medians over `--repeats` timed calls.
- step: `megatron-pdm train` of a SmolLM2-width model (llama layout, hidden 576, 9 query / 3 key-value heads of 64,
  FFN 1536, vocabulary 49,152, tied embeddings, `--layers` layers, random init) on the arithmetic task: 8 prompts x 8
  samples of 32 new tokens, 2 minibatches, TP 1; `perf/step_s` (rollout + training) of the steps after the first,
  in fp32, bf16 with torch's own GEMMs (MEGATRON_PDM_CPU_LOWP_GEMM=native: before the patch) and bf16 as the
  decision leaves it (auto: emulated where the CPU has no native bf16 GEMM). The rank takes os.cpu_count() threads
  (the launcher's share for one rank), whatever `--threads` says. `--rounds` interleaved rounds (every case once
  per round, in a rotated order): medians of the rounds' medians, with their spread [min-max].

`--avx2` simulates an AVX2-only host on any x86-64 CPU (ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2 in every
child). Prints a table and writes JSON (the CPU model, torch's CPU capability, the ISA environment, the decision,
every number) to `--out`.

    python benchmarks/lowp_gemm.py --avx2 [--threads 2] [--steps 3] [--out benchmarks/results/lowp_gemm_avx2.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
SMOLLM2_WIDTH = ["model.model_type=llama", "model.vocab_size=49152", "model.hidden_size=576",
                 "model.num_attention_heads=9", "model.num_query_groups=3", "model.head_dim=64",
                 "model.ffn_hidden_size=1536", "model.tie_word_embeddings=true", "model.rope_theta=100000",
                 "model.max_position_embeddings=128", "parallel.tensor=1", "rollout.n=8", "rollout.max_new_tokens=32",
                 "data.max_operand=20", "train.prompts_per_step=8", "train.micro_batch_size=8", "train.minibatches=2",
                 "train.warm_start_steps=0", "train.eval_every=1000", "train.eval_prompts=8",
                 "train.checkpoint_every=1000"]
STEP_CASES = {"fp32": ("fp32", "auto"), "bf16 torch": ("bf16", "native"), "bf16 auto": ("bf16", "auto")}

_GEMM_CHILD = """
import json, statistics, sys, time, torch, torch.nn.functional as F
from megatron_pdm.compat.cpu import _LowpGemmMode
M, K, N, repeats = 512, 576, 1536, int(sys.argv[1])
g = torch.Generator().manual_seed(0)
a, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
def rate(fn):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return 2 * M * K * N / statistics.median(times) / 1e9
out = {}
for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
    al, wl = a.to(dt), w.to(dt)
    out[name] = {"linear": rate(lambda: F.linear(al, wl)), "mm": rate(lambda: al @ wl.t())}
    if dt != torch.float32:
        with _LowpGemmMode(dt):
            out[name + " emulated"] = {"linear": rate(lambda: F.linear(al, wl)), "mm": rate(lambda: al @ wl.t())}
print(json.dumps(out))
"""

_HOST_CHILD = """
import json, torch
from megatron_pdm.compat import lowp_gemm_emulated
print(json.dumps({"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                  "emulated": {"bf16": lowp_gemm_emulated(torch.bfloat16), "fp16": lowp_gemm_emulated(torch.float16)}}))
"""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def child_env(avx2: bool, threads: int, **extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(AVX2_ENV if avx2 else {}), **extra}
    return {k: v for k, v in env.items() if v is not None}


def run_json(code: str, args: list[str], env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def step_times(precision: str, choice: str, *, env: dict, steps: int, layers: int) -> dict:
    """perf/step_s and perf/rollout_s of the steps after the first, and the whole command's wall time."""
    with tempfile.TemporaryDirectory() as run_dir:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "megatron_pdm.cli", "train", "--config",
                        str(ROOT / "examples" / "tiny_cpu.yaml"), "--run-dir", run_dir, *SMOLLM2_WIDTH,
                        f"model.num_layers={layers}", f"train.steps={steps}", f"precision.train={precision}",
                        f"precision.rollout={precision}"], env={**env, "MEGATRON_PDM_CPU_LOWP_GEMM": choice},
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t
        rows = [json.loads(r) for r in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if r.strip()]
    later = [r for r in rows if r.get("step", 0) >= 2 and "perf/step_s" in r]
    return {"step_s": statistics.median(r["perf/step_s"] for r in later),
            "rollout_s": statistics.median(r["perf/rollout_s"] for r in later),
            "steps_timed": len(later), "wall_s": wall}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--avx2", action="store_true", help="simulate an AVX2-only host (ONEDNN_MAX_CPU_ISA=AVX2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per GEMM")
    ap.add_argument("--steps", type=int, default=3, help="training steps per case (the first is not timed)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--cases", default=",".join(STEP_CASES), help="step cases to run, comma-separated")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/lowp_gemm[_avx2].json")
    args = ap.parse_args(argv)
    env = child_env(args.avx2, args.threads)
    host = {"cpu_model": cpu_model(), **run_json(_HOST_CHILD, [], env), "gemm_threads": args.threads,
            "rank_threads": os.cpu_count(),
            "isa_env": {k: env.get(k) for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")},
            "note": "a shared 2-core machine with other jobs running: ratios within one run, not absolute speeds"}
    gemm = run_json(_GEMM_CHILD, [str(args.repeats)], env)
    print(f"{host['cpu_model']}, torch {host['torch']} capability {host['cpu_capability']}, "
          f"ISA env {host['isa_env']}, emulated {host['emulated']}, {args.threads} threads")
    print(f"\n{'GEMM [512,576]x[576,1536]':28s} {'F.linear GFLOP/s':>17s} {'mm GFLOP/s':>11s}")
    for name, r in gemm.items():
        print(f"{name:28s} {r['linear']:17.1f} {r['mm']:11.1f}")
    cases = args.cases.split(",")
    rounds = {name: [] for name in cases}
    for r in range(args.rounds):
        for name in cases[r % len(cases):] + cases[:r % len(cases)]:
            rounds[name].append(step_times(*STEP_CASES[name], env=env, steps=args.steps, layers=args.layers))
    steps = {name: {**{k: statistics.median(x[k] for x in runs) for k in ("step_s", "rollout_s")},
                    "step_s_range": [min(x["step_s"] for x in runs), max(x["step_s"] for x in runs)],
                    "rounds": runs} for name, runs in rounds.items()}
    print(f"\n{'step (SmolLM2 width)':28s} {'step s':>8s} {'[min-max]':>15s} {'rollout s':>10s} {'x fp32':>7s}")
    base = steps.get("fp32", {}).get("step_s")
    for name, r in steps.items():
        ratio = f"{r['step_s'] / base:7.2f}" if base else "      -"
        lo, hi = r["step_s_range"]
        print(f"{name:28s} {r['step_s']:8.2f} {f'[{lo:.1f}-{hi:.1f}]':>15s} {r['rollout_s']:10.2f} {ratio}")
    out = args.out or ROOT / "benchmarks" / "results" / f"lowp_gemm{'_avx2' if args.avx2 else ''}.json"
    out.write_text(json.dumps({"host": host, "gemm_gflops": gemm, "step": steps,
                               "model": SMOLLM2_WIDTH + [f"model.num_layers={args.layers}"]}, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
