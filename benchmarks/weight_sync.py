"""Weight sync into rollout engines: seconds per update for each `rollout.weight_sync`, one run.

Launches `--engines` `megatron-pdm serve` engines (the embedded engine behind SGLang's API) for a Qwen3-layout
model of about `--hidden`-sized layers, then times `SGLangEngine.update_weights` (pause, transfer, load,
continue) for disk (HF export + /update_weights_from_disk), distributed (bucketed gloo broadcasts) and tensor
(shared-memory handles), after one warm-up update each. On a GPU machine the same client drives SGLang with
NCCL and CUDA IPC instead; these are the CPU numbers.

    python benchmarks/weight_sync.py [--engines 2] [--reps 3] [--out benchmarks/results/weight_sync.json]
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
from megatron_pdm.rollout.launcher import LaunchSpec  # noqa: E402
from megatron_pdm.rollout.sglang import WEIGHT_SYNCS, SGLangEngine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/weight_sync.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import transformers

    from megatron_pdm.models import hf_config_dict

    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                      num_attention_heads=8, num_query_groups=4, head_dim=args.hidden // 8,
                      ffn_hidden_size=3 * args.hidden, max_position_embeddings=256)
    hcfg = transformers.AutoConfig.for_model(
        **{k: v for k, v in hf_config_dict(cfg).items() if k not in ("architectures", "torch_dtype")})
    state = canonical_hf_state(transformers.AutoModelForCausalLM.from_config(hcfg).state_dict())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sync in WEIGHT_SYNCS:
            spec = LaunchSpec(server="megatron-pdm", num_engines=args.engines, dtype="float32",
                              log_dir=Path(tmp) / sync / "logs")
            engine = SGLangEngine((), cfg, weight_dir=Path(tmp) / sync / "weights", launch=spec, weight_sync=sync,
                                  bucket_bytes=args.bucket_mb << 20, timeout=600)
            try:
                engine.update_weights(state, version=0)  # launch
                engine.update_weights(state, version=1)  # warm-up
                times = []
                for v in range(2, 2 + args.reps):
                    t0 = time.perf_counter()
                    engine.update_weights(state, version=v)
                    times.append(time.perf_counter() - t0)
            finally:
                engine.close()
            rows.append({"weight_sync": sync, "seconds": statistics.median(times), "all": times})
    base = rows[0]["seconds"]
    print(f"{nbytes / 2**20:.0f} MiB of fp32 weights ({sum(t.numel() for t in state.values()) / 1e6:.1f} M "
          f"parameters) into {args.engines} engines; median of {args.reps}")
    print(f"{'weight_sync':<12} {'s / update':>11} {'GiB/s (all engines)':>20} {'vs disk':>8}")
    for r in rows:
        r["gib_per_s"] = nbytes * args.engines / r["seconds"] / 2**30
        print(f"{r['weight_sync']:<12} {r['seconds']:>11.3f} {r['gib_per_s']:>20.2f} {base / r['seconds']:>7.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bytes": nbytes, "engines": args.engines, "reps": args.reps, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
