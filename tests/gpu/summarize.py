"""The summary of tests/gpu/run_all.sh: one JSON object per check (status, seconds, key numbers) and a table.

    python tests/gpu/summarize.py --steps OUT/steps.jsonl --out OUT/summary.json

`steps.jsonl` holds one line per check as the script ran it: {"name", "kind", "status", "seconds", "rc", "log"}
(status: passed, failed, timeout, or "skipped (why)"). The key numbers come from what each check wrote under the
output directory (a run's metrics.jsonl, the checks' JSON files) or from its pytest log; a check whose command
passed but whose numbers show a problem (a missing step, a non-finite loss, nothing but skips) is marked so.
Exit status: 1 if any check that ran failed or timed out, else 0.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path


def _pytest_counts(log: Path) -> dict:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", text)}


def _train(step: dict, out: Path) -> tuple[dict, str | None]:
    path = out / "runs" / step["name"] / "metrics.jsonl"
    if not path.is_file():
        return {}, f"no {path}"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    last = rows[-1] if rows else {}
    keys = ("train/reward", "train/loss", "train/grad_norm", "mismatch_start/kl_k3", "mask/masked_frac",
            "eval/reward", "perf/step_s", "perf/tokens_per_s")
    numbers = {"steps": [r["step"] for r in rows], **{k: last[k] for k in keys if k in last}}
    if numbers["steps"][-1:] != [3]:
        return numbers, f"the run logged steps {numbers['steps']}, not up to 3"
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    norms = [r.get("train/grad_norm", float("nan")) for r in rows[1:]]
    if not losses or not all(math.isfinite(x) for x in losses + norms):
        return numbers, f"train/loss {losses}, train/grad_norm {norms}"
    if not any(norms):
        return numbers, "train/grad_norm 0 at every step: no backward was exercised"
    return numbers, None


def _policy_loss(step: dict, out: Path) -> tuple[dict, str | None]:
    path = out / "policy_loss_gpu.json"
    counts = _pytest_counts(Path(step["log"]))
    if not path.is_file():
        return counts, None if step["status"] != "passed" else f"no {path}"
    cases = json.loads(path.read_text())
    numbers = {"cases": len(cases), **counts, "mask_flips": sum(c["mask_flips"] for c in cases.values())}
    for key in ("logprobs_rel_err", "divergence_rel_err", "predicted_change_rel_err", "grad_rel_err", "loss_rel_err"):
        values = [c[key] for c in cases.values() if key in c]
        if values:
            numbers[f"max_{key}"] = max(values)
    return numbers, None


def _kernels(step: dict, out: Path) -> tuple[dict, str | None]:
    path = out / "gpu_vocab_parallel.json"
    if not path.is_file():
        return {}, None if step["status"] != "passed" else f"no {path}"
    d = json.loads(path.read_text())
    numbers = {"device": d.get("device"), "checks_ok": sum(c["ok"] for c in d["checks"]),
               "checks": len(d["checks"]), "max_abs_err": max(c["max_abs_err"] for c in d["checks"]),
               "read_bandwidth_gb_s": round(d["copy_read_bandwidth_gb_s"], 1)}
    for r in d["timings"]:
        shape = f"T{r['T']}xV{r['V_local']}"
        numbers[f"{shape}/fused_fwd_bwd_ms"] = round(r["fused_fwd_bwd_ms"], 3)
        numbers[f"{shape}/torch_over_fused"] = round(r["torch_fwd_bwd_ms"] / r["fused_fwd_bwd_ms"], 2)
        numbers[f"{shape}/fused_over_floor"] = round(r["fused_fwd_bwd_ms"] / r["floor_fwd_bwd_ms"], 2)
    return numbers, None


def _pytest(step: dict, out: Path) -> tuple[dict, str | None]:
    numbers = _pytest_counts(Path(step["log"]))
    extra = out / "sglang_gpu.json"
    if step["kind"] == "sglang" and extra.is_file():
        numbers.update(json.loads(extra.read_text()))
    return numbers, None


KINDS = {"train": _train, "policy_loss": _policy_loss, "kernels": _kernels, "pytest": _pytest, "sglang": _pytest}


def summarize(steps: list[dict], out: Path) -> list[dict]:
    rows = []
    for step in steps:
        row = {**step, "numbers": {}}
        if not step["status"].startswith("skipped"):
            numbers, problem = KINDS[step["kind"]](step, out)
            row["numbers"] = numbers
            if step["status"] == "passed" and problem:
                row["status"] = f"failed ({problem})"
            elif step["status"] == "passed" and step["kind"] in ("pytest", "sglang", "policy_loss") \
                    and not numbers.get("passed") and numbers.get("skipped"):
                row["status"] = "skipped (pytest skipped every test)"
        rows.append(row)
    return rows


def failed(row: dict) -> bool:
    return row["status"].startswith(("failed", "timeout"))


def _short(numbers: dict, width: int = 70) -> str:
    text = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in numbers.items())
    return text if len(text) <= width else text[: width - 3] + "..."


def table(rows: list[dict]) -> str:
    lines = [f"{'check':<14} {'status':<34} {'seconds':>8}  key numbers", "-" * 110]
    for r in rows:
        lines.append(f"{r['name']:<14} {r['status'][:34]:<34} {r['seconds']:>8.1f}  {_short(r['numbers'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", required=True, help="steps.jsonl written by run_all.sh")
    ap.add_argument("--out", required=True, help="summary JSON to write")
    ap.add_argument("--environment", default="{}", help="a JSON object describing the machine")
    args = ap.parse_args(argv)
    steps_path = Path(args.steps)
    steps = [json.loads(line) for line in steps_path.read_text().splitlines() if line.strip()]
    rows = summarize(steps, steps_path.parent)
    bad = [r["name"] for r in rows if failed(r)]
    summary = {"environment": json.loads(args.environment), "checks": rows,
               "ran": sum(not r["status"].startswith("skipped") for r in rows), "failed": bad,
               "seconds": round(sum(r["seconds"] for r in rows), 1)}
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(table(rows))
    print(f"{summary['ran']} of {len(rows)} checks ran, {len(bad)} failed{': ' + ', '.join(bad) if bad else ''}; "
          f"{summary['seconds']:.0f} s; summary in {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
