"""`megatron-pdm analyze`: the paper's token-level alignment study on your model and setting.

For each seed, from the same initial weights: roll out `rollouts` responses, take `pre_updates` optimizer steps on
them (the policy drifts from the rollout policy mu, as in the later mini-batches of a step; with on-policy fp32
rollouts D is zero before the first update), then record per token D, the ratio direction sign(A (r - 1)) and
the PDM direction sign(A Ddot); take one more real optimizer step with the training loss; recompute D. On the
tokens outside the trust region where the two rules disagree, each rule's kept tokens are unsafe (D rose) or
corrective (D fell): `objectives.alignment_rates`. Reported per seed and pooled, for the top-K KL with both
tails and for the exact KL(mu || pi) (mu's logits are the model's at the rollout weights), with a paired
bootstrap confidence interval over seeds for the difference of unsafe-keep rates (ratio - PDM).

Several pre-update counts (`--pre-updates 1,2,4,8`: mu ever staler) share each seed's rollout, the weights and the
optimizer reset before each count. A seed's rows are appended to seeds.jsonl as it finishes, so a study stopped
part-way resumes where it was when run again with the same config, rollouts and counts (`finished_seeds`).
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_pdm._jsonl import write_atomic
from megatron_pdm._rundir import RunDir
from megatron_pdm._validate import is_int
from megatron_pdm.compat import lowp_gemm_scope
from megatron_pdm.models import forward_logits
from megatron_pdm.objectives import alignment_rates, compute_advantages, loss_normalizer
from megatron_pdm.vocab_parallel import BehaviorLogits, policy_statistics

from .rollouts import step_seed, training_batch
from .trainer import Trainer

RULES = (("topk_kl", "aggregated"), ("topk_kl", "uniform"), ("kl", "aggregated"))


def _name(kind, tail):
    return "exact_kl" if kind == "kl" else f"{kind}_{tail}"


def bootstrap_ci(diffs: list[float], *, samples: int = 2000, level: float = 0.95, seed: int = 0):
    """Percentile bootstrap CI of the mean of paired per-seed differences (seeds with no kept token dropped)."""
    diffs = [d for d in diffs if d == d]
    if not diffs:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(diffs) for _ in diffs) / len(diffs) for _ in range(samples))
    lo = means[int((1 - level) / 2 * samples)]
    hi = means[min(samples - 1, int((1 + level) / 2 * samples))]
    return lo, hi


def pre_update_counts(text) -> tuple[int, ...]:
    """--pre-updates: one count or a comma-separated list (`1,2,4,8`, or a sequence of ints) of distinct integers
    >= 0."""
    try:
        counts = tuple(int(x) for x in (text if isinstance(text, (list, tuple)) else str(text).split(",")))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 0 or len(set(counts)) != len(counts):
        raise ValueError(f"--pre-updates: expected distinct integers >= 0 separated by commas (e.g. 1,2,4,8), got "
                         f"{text!r}")
    return counts


def check_rollouts(rollouts, n: int) -> int:
    """--rollouts: a multiple of rollout.n, at least n (the study rolls out rollouts / n prompts of n responses
    each; anything else would be rounded to another count than the one asked for)."""
    if not is_int(rollouts) or rollouts < n or rollouts % n:
        raise ValueError(f"--rollouts: expected a multiple of rollout.n = {n} (rollouts / n prompts of n responses "
                         f"each), got {rollouts!r}")
    return rollouts


def check_layout(parallel, dp: int) -> None:
    """The study runs with DP = PP = CP = 1 (`megatron-pdm analyze` checks before any process starts)."""
    if dp > 1 or parallel.pipeline > 1 or parallel.context > 1:
        raise ValueError(f"parallel: the analysis runs with data, pipeline and context parallelism 1 (tensor / expert "
                         f"parallel are fine), got DP = {dp}, PP = {parallel.pipeline}, CP = {parallel.context}")


def check_objective(objective) -> None:
    """The study steps on the rollouts alone: no step-start forward pass (`needs_step_start_pass`: a correction's
    pi_old, a proximal anchor, a rejection's or veto's mismatch) and no frozen reference (`needs_reference`: the KL
    penalty), whose log-probabilities the loss would then require. ValueError naming the fields that ask for them
    (`megatron-pdm analyze` checks before any process starts, rather than after the model is built)."""
    if not (objective.needs_step_start_pass or objective.needs_reference):
        return
    asks = {"correction": objective.correction != "none", "rejection": objective.rejection != "none",
            "veto_threshold": objective.veto_threshold is not None, "anchor": objective.anchor == "proximal",
            "kl_coef": objective.needs_reference}
    named = ", ".join(f"objective.{k} = {getattr(objective, k)!r}" for k, on in asks.items() if on) or "objective"
    raise ValueError(f"{named}: the analysis measures the loss without a step-start pass (pi_old) or a reference "
                     "model; use objective.correction 'none', rejection 'none', veto_threshold null, anchor "
                     "'behavior' and kl_coef 0")


class Analysis:
    def __init__(self, trainer: Trainer):
        self.t = trainer
        check_layout(trainer.cfg.parallel, trainer.parallel.dp)
        check_objective(trainer.cfg.objective)

    @torch.no_grad()
    def _logits(self, batch):
        t = self.t
        out = []
        with lowp_gemm_scope(t.learner.config.params_dtype):
            for mb in batch.micro_batches(t.cfg.train.micro_batch_size):
                out.append(mb.response_logits(forward_logits(t.learner.ddp[0], mb.input_ids)).float())
        return torch.cat(out)

    def _stats(self, z, batch, mu_logits, kind, tail):
        t = self.t
        beh = batch.behavior if kind != "kl" else BehaviorLogits(batch.behavior.token_ids, mu_logits)
        return policy_statistics(z, beh, kind, tail=tail, group=t.parallel.tp_group,
                                 temperature=t.cfg.rollout.temperature)

    def rollout(self, seed: int, rollouts: int) -> dict:
        """One seed's rollouts from the current (initial) weights, shared by every estimator and pre-update count:
        the training batch, the rollout weights' logits shard (mu of the exact divergence), the micro-batches."""
        t, cfg = self.t, self.t.cfg
        n = cfg.rollout.n
        prompts = rollouts // n  # a multiple of n (check_rollouts)
        samples, rewards, _ = t.rollouts.rollout(t.rollouts.sample_prompts(prompts, step_seed(seed, 0, 11)), n,
                                              step_seed(seed, 0, 12))
        samples = t.rollouts.share(samples)  # every TP rank builds the batch
        adv = compute_advantages(cfg.objective.advantage, rewards, n, eps=cfg.objective.advantage_std_eps)
        batch = training_batch(cfg, samples, adv, pad_id=t.tokenizer.pad_id).to(t.device)
        # as the trainer normalises a step: loss tokens only (not a multi-turn tool's, a masked overlong response's)
        normalizer = loss_normalizer(batch.loss_mask, batch.sequence_ids, cfg.objective.aggregation,
                                     group=t.parallel.dp_group)
        size = cfg.train.micro_batch_size
        mbs = t.learner.micro_batches(batch, [min(size, batch.rows - s) for s in range(0, batch.rows, size)])
        return {"batch": batch, "rewards": rewards, "mu_logits": self._logits(batch), "normalizer": normalizer,
                "mbs": mbs}

    def measure(self, seed: int, ro: dict, pre_updates: int) -> dict:
        """From the weights and optimizer as they are: `pre_updates` optimizer steps on the rollouts, D and both
        directions per token, one more step, D again; each rule's unsafe / corrective keeps per estimator."""
        t, cfg, batch = self.t, self.t.cfg, ro["batch"]

        def step():
            t.learner.update(ro["mbs"], lambda mb, logits: t.learner.rl_loss(mb, logits, ro["normalizer"]))

        skipped = t.learner.updates_skipped
        for _ in range(pre_updates):
            step()
        z_before = self._logits(batch)
        before = {r: self._stats(z_before, batch, ro["mu_logits"], *r) for r in RULES}
        step()
        z_after = self._logits(batch)
        out = {"seed": seed, "pre_updates": pre_updates, "tokens": len(batch.advantages),
               "reward": float(ro["rewards"].mean()),
               "updates_skipped": t.learner.updates_skipped - skipped}  # fp16 overflows: fewer real updates
        for kind, tail in RULES:
            b = before[kind, tail]
            d_after = self._stats(z_after, batch, ro["mu_logits"], kind, tail).divergence
            rates = alignment_rates(b.divergence, d_after, b.logprobs - b.behavior_logprobs, b.predicted_change,
                                    batch.advantages.to(b.divergence.dtype), delta=cfg.objective.delta)
            out[_name(kind, tail)] = rates
        return out


def summarize(per_seed: list[dict]) -> dict:
    """Per estimator: pooled and per-seed-mean unsafe / corrective keep rates of both rules, disagreement counts,
    the seeds where PDM keeps fewer unsafe tokens, and the bootstrap CI of the per-seed (ratio - PDM) difference."""
    out = {}
    for kind, tail in RULES:
        key = _name(kind, tail)
        rows = [s[key] for s in per_seed]
        pooled = {}
        for rule in ("ratio", "pdm"):
            kept = sum(r[f"{rule}_kept"] for r in rows)
            unsafe = sum(r[f"{rule}_unsafe_keep_rate"] * r[f"{rule}_kept"] for r in rows if r[f"{rule}_kept"])
            corrective = sum(r[f"{rule}_corrective_keep_rate"] * r[f"{rule}_kept"] for r in rows if r[f"{rule}_kept"])
            pooled[f"{rule}_unsafe_keep_rate"] = unsafe / kept if kept else float("nan")
            pooled[f"{rule}_corrective_keep_rate"] = corrective / kept if kept else float("nan")
            mean = [r[f"{rule}_unsafe_keep_rate"] for r in rows if r[f"{rule}_kept"]]
            pooled[f"{rule}_unsafe_keep_rate_seed_mean"] = sum(mean) / len(mean) if mean else float("nan")
        diffs = [r["ratio_unsafe_keep_rate"] - r["pdm_unsafe_keep_rate"] for r in rows]
        valid = [d for d in diffs if d == d]
        lo, hi = bootstrap_ci(diffs)
        out[key] = {
            "outside_per_seed": sum(r["outside"] for r in rows) / len(rows),
            "disagree_per_seed": sum(r["disagree"] for r in rows) / len(rows),
            **pooled,
            "seeds_pdm_better": sum(d > 0 for d in valid),
            "seeds_compared": len(valid),
            "unsafe_diff_ratio_minus_pdm_ci95": [lo, hi],
        }
    return out


def plot(per_seed: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(RULES), figsize=(4 * len(RULES), 4))
    counts = sorted({s["pre_updates"] for s in per_seed})
    for ax, (kind, tail) in zip(axes, RULES, strict=True):
        key = _name(kind, tail)
        for p in counts:
            pts = [(s[key]["ratio_unsafe_keep_rate"], s[key]["pdm_unsafe_keep_rate"]) for s in per_seed
                   if s["pre_updates"] == p]
            pts = [q for q in pts if q[0] == q[0] and q[1] == q[1]]
            ax.scatter([q[0] for q in pts], [q[1] for q in pts], s=14, label=f"{p} pre-update(s)")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set_xlabel("ratio rule: unsafe-keep rate")
        ax.set_ylabel("PDM rule: unsafe-keep rate")
        ax.set_title(key)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    if len(counts) > 1:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# config keys that do not change what a study measures: a resume may differ in them
_NOT_MEASURED = ("logging", "train.steps", "train.eval_every", "train.checkpoint_every", "train.keep_last",
                 "train.async_save")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flat(v, f"{key}.") if isinstance(v, dict) and v else {key: v})
    return out


def study_identity(cfg, rollouts: int, pre_updates: tuple[int, ...]) -> dict:
    """What a study measures, less its seed count: a rerun with the same identity resumes it (and may add seeds).
    Flat dotted keys (`config.objective.delta`), JSON-normalized; the keys of `_NOT_MEASURED` left out."""
    flat = {k: v for k, v in _flat({"config": cfg.to_dict()}).items()
            if not any(k == f"config.{x}" or k.startswith(f"config.{x}.") for x in _NOT_MEASURED)}
    return json.loads(json.dumps({**flat, "rollouts": rollouts, "pre_updates": list(pre_updates)}))


def finished_seeds(out_dir, identity: dict) -> dict[int, list[dict]]:
    """The seeds a study in out_dir finished (every pre-update count), or {} for a new study. A study of another
    identity there, or a study.json or seeds.jsonl row that is JSON but not what the study wrote, is an error naming
    the file (and each key that differs); a line cut short by a kill is ignored."""
    run = RunDir(out_dir)
    if not run.study.is_file():
        return {}
    restart = "remove the directory to start the study over"
    try:
        theirs = json.loads(run.study.read_bytes())
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"--out-dir {str(out_dir)!r}: {run.study} is not valid JSON ({e}); {restart}") from None
    if not isinstance(theirs, dict):
        raise ValueError(f"--out-dir {str(out_dir)!r}: {run.study} holds {json.dumps(theirs)[:60]}, not a study's "
                         f"settings (a JSON object); {restart}")
    if theirs != identity:
        differ = [f"{k}: {theirs.get(k, '(unset)')!r} there, {identity.get(k, '(unset)')!r} now"
                  for k in sorted(set(theirs) | set(identity)) if theirs.get(k) != identity.get(k)]
        raise ValueError(f"--out-dir {str(out_dir)!r}: holds a study of another setting ({'; '.join(differ[:5])}"
                         f"{'; ...' if len(differ) > 5 else ''}); give another --out-dir, or remove it to start over")
    rows: dict[int, list[dict]] = {}
    if run.study_seeds.is_file():
        for lineno, line in enumerate(run.study_seeds.read_bytes().splitlines(), start=1):
            try:
                row = json.loads(line)
            except ValueError:  # the line a kill cut short: that seed runs again
                continue
            if not _seed_row(row, identity["pre_updates"]):
                shown = line[:60].decode(errors="replace")
                raise ValueError(f"{run.study_seeds}:{lineno}: not a seed's row (an object with an integer seed, one "
                                 f"of the pre-update counts and every estimator's rates): {shown!r}; {restart}")
            rows.setdefault(row["seed"], []).append(row)
    counts = sorted(identity["pre_updates"])
    return {seed: r for seed, r in rows.items() if sorted(x["pre_updates"] for x in r) == counts}


def _seed_row(row, counts: list[int]) -> bool:
    """Whether a seeds.jsonl row is one `Analysis.measure` wrote (what `summarize` and the resume read)."""
    return (isinstance(row, dict) and is_int(row.get("seed")) and is_int(row.get("pre_updates"))
            and row["pre_updates"] in counts and all(isinstance(row.get(_name(*rule)), dict) for rule in RULES))


def run_analysis(cfg, out_dir, *, seeds: int, rollouts: int, pre_updates=(1,), progress: bool = True) -> dict:
    """On every rank (DP = 1); rank 0 writes study.json, seeds.jsonl (a seed's rows as it finishes: a rerun
    resumes), analysis.json and analysis.png into out_dir."""
    out_dir, pre_updates = Path(out_dir), pre_update_counts(pre_updates)
    check_rollouts(rollouts, cfg.rollout.n)
    identity = study_identity(cfg, rollouts, pre_updates)
    box = [finished_seeds(out_dir, identity) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # rank 0's reading: every rank runs the same seeds
    done = box[0]
    cfg = replace(cfg, train=replace(cfg.train, checkpoint_every=10**9))
    trainer = Trainer(cfg, out_dir)
    start = time.monotonic()
    try:
        per_seed = _seeds(trainer, cfg, seeds, rollouts, pre_updates, done, identity, progress)
    finally:
        if trainer.engine is not None:
            trainer.engine.close()
        trainer.schedule.close()
        trainer.learner.close()  # a later stage's weights group with the engines
        trainer.parallel.close()
    result = {"config": {"seeds": seeds, "rollouts": rollouts, "pre_updates": list(pre_updates),
                         "delta": cfg.objective.delta, "lr": cfg.optim.lr},
              "summary": {str(p): summarize([s for s in per_seed if s["pre_updates"] == p]) for p in pre_updates},
              "per_seed": per_seed}
    if dist.get_rank() == 0:
        run = RunDir(out_dir)
        write_atomic(run.analysis, json.dumps(result, indent=2) + "\n")  # a rerun replaces it whole
        trainer.logger.write_config()  # the resolved config beside it (the trainer's logger writes it at a run's start)
        plot(per_seed, run.analysis_plot)
    result["seconds"] = time.monotonic() - start  # this invocation's (a resumed study's earlier seeds not counted)
    return result


def _seeds(trainer, cfg, seeds, rollouts, pre_updates, done, identity, progress) -> list[dict]:
    """Every seed's rows, each measurement from the same initial weights and a fresh optimizer: one rollout per
    seed, then per pre-update count the weights reset. A finished seed is read back instead of run again."""
    trainer.initialize()
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    initial = [p.detach().clone() for p in params]
    analysis = Analysis(trainer)
    writer = dist.get_rank() == 0
    if writer:  # the finished seeds only: a seed cut short by a kill (and a cut line) is dropped, then run again
        run = trainer.run_dir
        run.path.mkdir(parents=True, exist_ok=True)
        if not run.study.is_file():
            write_atomic(run.study, json.dumps(identity) + "\n")
        write_atomic(run.study_seeds, "".join(json.dumps(r) + "\n" for rows in done.values() for r in rows))
    todo = [s for s in range(seeds) if s not in done]
    bar = _Progress(len(todo) * len(pre_updates), enabled=writer and progress)

    def reset():
        with torch.no_grad():
            for p, p0 in zip(params, initial, strict=True):
                p.copy_(p0)
        trainer.learner.optimizer = trainer.learner.new_optimizer(cfg.optim.lr)

    per_seed = []
    with bar:
        for seed in range(seeds):
            if seed in done:
                per_seed += sorted(done[seed], key=lambda r: pre_updates.index(r["pre_updates"]))
                continue
            reset()
            trainer.sync_weights(0)
            ro = analysis.rollout(seed, rollouts)
            rows = []
            for i, p in enumerate(pre_updates):
                if i:
                    reset()
                rows.append(analysis.measure(seed, ro, p))
                bar.advance(f"seed {seed}, {p} pre-update(s)")
            per_seed += rows
            if writer:  # one append per seed: a kill leaves whole seeds and at most one cut line
                with trainer.run_dir.study_seeds.open("a") as f:
                    f.write("".join(json.dumps(r) + "\n" for r in rows))
    return per_seed


class _Progress:
    """The study's progress (rank 0; the measurements left, of this invocation): a bar with elapsed time and ETA on a
    terminal, else one line per measurement (a log file, a Slurm job's output)."""

    def __init__(self, total: int, *, enabled: bool):
        self.bar, self.total, self.done = None, total, 0
        self.enabled = enabled and total > 0
        if self.enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("[bold]analyze"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                                console=Console(stderr=True))
            self.task = self.bar.add_task("analyze", total=total, info="")

    def __enter__(self):
        self.start = time.monotonic()
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def advance(self, info: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=info)
        elif self.enabled:
            elapsed = time.monotonic() - self.start
            eta = elapsed / self.done * (self.total - self.done)
            print(f"analyze: {self.done}/{self.total} measurements ({info}), {elapsed / 60:.1f} min elapsed, "
                  f"ETA {eta / 60:.1f} min", file=sys.stderr, flush=True)


def format_summary(summary: dict) -> str:
    """One table per pre-update count (summary: {count: {estimator: ...}})."""
    lines = []
    for count, rows in summary.items():
        lines.append(f"pre-updates {count}")
        lines.append(f"{'estimator':<20} {'outside/seed':>12} {'disagree/seed':>13} {'unsafe ratio':>12} "
                     f"{'unsafe PDM':>10} {'correct. ratio':>14} {'correct. PDM':>12} {'PDM better':>10} "
                     f"{'diff CI95':>17}")
        for key, s in rows.items():
            lo, hi = s["unsafe_diff_ratio_minus_pdm_ci95"]
            lines.append(
                f"{key:<20} {s['outside_per_seed']:>12.1f} {s['disagree_per_seed']:>13.1f} "
                f"{s['ratio_unsafe_keep_rate']:>12.3f} {s['pdm_unsafe_keep_rate']:>10.3f} "
                f"{s['ratio_corrective_keep_rate']:>14.3f} {s['pdm_corrective_keep_rate']:>12.3f} "
                f"{s['seeds_pdm_better']:>4}/{s['seeds_compared']:<5} [{lo:+.3f}, {hi:+.3f}]")
    return "\n".join(lines)
