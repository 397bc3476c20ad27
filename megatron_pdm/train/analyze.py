"""`megatron-pdm analyze`: the paper's token-level alignment study on your model and setting.

For each seed, from the same initial weights: roll out `rollouts` responses, take `pre_updates` optimizer steps on
them (the policy drifts from the rollout policy mu, as in the later mini-batches of a step; with on-policy fp32
rollouts D is zero before the first update), then record per token D, the ratio direction sign(A (r - 1)) and
the PDM direction sign(A Ddot); take one more real optimizer step with the training loss; recompute D. On the
tokens outside the trust region where the two rules disagree, each rule's kept tokens are unsafe (D rose) or
corrective (D fell): `objectives.alignment_rates`. Reported per seed and pooled, for the top-K KL with both
tails and for the exact KL(mu || pi) (mu's logits are the model's at the rollout weights), with a paired
bootstrap confidence interval over seeds for the difference of unsafe-keep rates (ratio - PDM).
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

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


def check_layout(parallel, dp: int) -> None:
    """The study runs with DP = PP = CP = 1 (`megatron-pdm analyze` checks before any process starts)."""
    if dp > 1 or parallel.pipeline > 1 or parallel.context > 1:
        raise ValueError(f"parallel: the analysis runs with data, pipeline and context parallelism 1 (tensor / expert "
                         f"parallel are fine), got DP = {dp}, PP = {parallel.pipeline}, CP = {parallel.context}")


class Analysis:
    def __init__(self, trainer: Trainer):
        self.t = trainer
        check_layout(trainer.cfg.parallel, trainer.parallel.dp)

    @torch.no_grad()
    def _logits(self, batch):
        t = self.t
        out = []
        for mb in batch.micro_batches(t.cfg.train.micro_batch_size):
            out.append(mb.response_logits(forward_logits(t.learner.ddp[0], mb.input_ids)).float())
        return torch.cat(out)

    def _stats(self, z, batch, mu_logits, kind, tail):
        t = self.t
        beh = batch.behavior if kind != "kl" else BehaviorLogits(batch.behavior.token_ids, mu_logits)
        return policy_statistics(z, beh, kind, tail=tail, group=t.parallel.tp_group,
                                 temperature=t.cfg.rollout.temperature)

    def seed(self, seed: int, rollouts: int, pre_updates: int) -> dict:
        t, cfg = self.t, self.t.cfg
        n = cfg.rollout.n
        prompts = max(1, rollouts // n)
        samples, rewards, _ = t.rollouts.rollout(t.rollouts.sample_prompts(prompts, step_seed(seed, 0, 11)), n,
                                              step_seed(seed, 0, 12))
        samples = t.rollouts.share(samples)  # every TP rank builds the batch
        adv = compute_advantages(cfg.objective.advantage, rewards, n, eps=cfg.objective.advantage_std_eps)
        batch = training_batch(cfg, samples, adv, pad_id=t.tokenizer.pad_id).to(t.device)
        mu_logits = self._logits(batch)  # the rollout weights' logits shard: mu for the exact divergence
        normalizer = loss_normalizer(torch.ones(batch.num_tokens, device=t.device), batch.sequence_ids,
                                     cfg.objective.aggregation)
        size = cfg.train.micro_batch_size
        mbs = t.learner.micro_batches(batch, [min(size, batch.rows - s) for s in range(0, batch.rows, size)])

        def step():
            t.learner.update(mbs, lambda mb, logits: t.learner.rl_loss(mb, logits, normalizer))

        for _ in range(pre_updates):
            step()
        z_before = self._logits(batch)
        before = {r: self._stats(z_before, batch, mu_logits, *r) for r in RULES}
        step()
        z_after = self._logits(batch)
        out = {"seed": seed, "tokens": len(batch.advantages), "reward": float(rewards.mean())}
        for kind, tail in RULES:
            b = before[kind, tail]
            d_after = self._stats(z_after, batch, mu_logits, kind, tail).divergence
            rates = alignment_rates(b.divergence, d_after, b.logprobs - b.behavior_logprobs, b.predicted_change,
                                    batch.advantages.to(b.divergence.dtype), delta=cfg.objective.delta)
            out[_name(kind, tail)] = rates
        return out


def summarize(per_seed: list[dict]) -> dict:
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
    for ax, (kind, tail) in zip(axes, RULES, strict=True):
        key = _name(kind, tail)
        pts = [(s[key]["ratio_unsafe_keep_rate"], s[key]["pdm_unsafe_keep_rate"]) for s in per_seed]
        pts = [p for p in pts if p[0] == p[0] and p[1] == p[1]]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14)
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set_xlabel("ratio rule: unsafe-keep rate")
        ax.set_ylabel("PDM rule: unsafe-keep rate")
        ax.set_title(key)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_analysis(cfg, out_dir, *, seeds: int, rollouts: int, pre_updates: int = 1) -> dict:
    """On every rank (DP = 1); rank 0 writes analysis.json and analysis.png into out_dir."""
    out_dir = Path(out_dir)
    cfg = replace(cfg, train=replace(cfg.train, checkpoint_every=10**9))
    trainer = Trainer(cfg, out_dir)
    try:
        per_seed = _seeds(trainer, cfg, seeds, rollouts, pre_updates)
    finally:
        if trainer.engine is not None:
            trainer.engine.close()
        trainer.schedule.close()
        trainer.parallel.close()
    result = {"config": {"seeds": seeds, "rollouts": rollouts, "pre_updates": pre_updates,
                         "delta": cfg.objective.delta, "lr": cfg.optim.lr},
              "summary": summarize(per_seed), "per_seed": per_seed}
    if dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "analysis.json").write_text(json.dumps(result, indent=2) + "\n")
        trainer.logger.write_config()  # the resolved config beside it (the trainer's logger writes it at a run's start)
        plot(per_seed, out_dir / "analysis.png")
    return result


def _seeds(trainer, cfg, seeds: int, rollouts: int, pre_updates: int) -> list[dict]:
    """Every seed's statistics, each from the same initial weights and a fresh optimizer."""
    trainer.initialize()
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    initial = [p.detach().clone() for p in params]
    analysis = Analysis(trainer)
    per_seed = []
    for seed in range(seeds):
        with torch.no_grad():
            for p, p0 in zip(params, initial, strict=True):
                p.copy_(p0)
        trainer.learner.optimizer = trainer.learner.new_optimizer(cfg.optim.lr)
        trainer.sync_weights(0)
        per_seed.append(analysis.seed(seed, rollouts, pre_updates))
    return per_seed


def format_summary(summary: dict) -> str:
    lines = [f"{'estimator':<20} {'outside/seed':>12} {'disagree/seed':>13} {'unsafe ratio':>12} {'unsafe PDM':>10} "
             f"{'correct. ratio':>14} {'correct. PDM':>12} {'PDM better':>10} {'diff CI95':>17}"]
    for key, s in summary.items():
        lo, hi = s["unsafe_diff_ratio_minus_pdm_ci95"]
        lines.append(
            f"{key:<20} {s['outside_per_seed']:>12.1f} {s['disagree_per_seed']:>13.1f} "
            f"{s['ratio_unsafe_keep_rate']:>12.3f} {s['pdm_unsafe_keep_rate']:>10.3f} "
            f"{s['ratio_corrective_keep_rate']:>14.3f} {s['pdm_corrective_keep_rate']:>12.3f} "
            f"{s['seeds_pdm_better']:>4}/{s['seeds_compared']:<5} [{lo:+.3f}, {hi:+.3f}]")
    return "\n".join(lines)
