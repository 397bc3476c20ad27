"""The batch side of a step: prompts to rollouts (through the `RolloutEngine` protocol only), rewards, dynamic
sampling, evaluation, and the step's samples to this rank's training micro-batches with their advantages.

Rank 0 owns the engine and scores every sample once; the samples are broadcast to every rank, which keeps only
its own rows' tensors (`step_batches`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_pdm.objectives import compute_advantages
from megatron_pdm.rollout import RolloutEngine, RolloutSample, SamplingParams

from .batch import Batch, informative_groups, overlong_penalty, plan_minibatches, rollout_batch
from .config import Config
from .data import PromptSet, RLData, load_reward, score


def step_seed(seed: int, step: int, salt: int) -> int:
    """The seed of one draw at one step: prompts and rollouts are a function of (train.seed, step) alone, so a
    resumed run, at any layout, draws what the uninterrupted run drew."""
    return (seed * 1_000_003 + step * 7919 + salt) % (2**62)


class Rollouts:
    """Prompts, rollouts and rewards on every rank; `engine` is the rollout engine on rank 0 (None elsewhere)."""

    def __init__(self, cfg: Config, data: RLData, engine: RolloutEngine | None):
        self.cfg, self.data, self.engine = cfg, data, engine
        self.tokenizer = data.tokenizer
        self.reward_fn = load_reward(cfg.data.reward) if engine is not None else None  # scored once, on rank 0

    def sample_prompts(self, count: int, seed: int) -> PromptSet:
        """`count` training prompts drawn uniformly with replacement (the same on every rank for the same seed)."""
        train = self.data.train
        idx = torch.randint(0, len(train.problems), (count,), generator=torch.Generator().manual_seed(seed)).tolist()
        return PromptSet([train.problems[i] for i in idx], [train.prompt_ids[i] for i in idx])

    def rollout(self, prompts: PromptSet, n: int, seed: int, *, temperature: float | None = None,
                top_p: float | None = None) -> tuple[list[RolloutSample], torch.Tensor]:
        """n samples per prompt from rank 0's engine and their rewards (scored on rank 0), broadcast to every rank
        (one pickled broadcast: the samples with their [L, K] top-K)."""
        r = self.cfg.rollout
        params = SamplingParams(max_new_tokens=r.max_new_tokens, n=n, temperature=temperature or r.temperature,
                                top_k_logprobs=self.cfg.objective.top_k, stop_token_ids=self.tokenizer.stop_ids,
                                seed=seed, top_p=r.top_p if top_p is None else top_p, top_k=r.top_k,
                                return_routed_experts=r.routed_experts)
        box = [None]
        if self.engine is not None:
            samples = self.engine.generate(prompts.prompt_ids, params)
            rewards = [score(self.reward_fn, self.tokenizer.decode(s.response_ids.tolist()),
                             prompts.problems[s.prompt_index], i) for i, s in enumerate(samples)]
            box[0] = (samples, torch.tensor(rewards, dtype=torch.float32))
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def evaluate(self, step: int) -> dict:
        """eval/reward (avg@k: the mean reward of train.eval_samples responses per prompt) and eval/pass@k, per
        evaluation set as eval/<name>/...; eval/reward is then the mean over the sets."""
        t, out = self.cfg.train, {}
        for i, (name, prompts) in enumerate(self.data.evals.items()):
            _, rewards = self.rollout(prompts, t.eval_samples, step_seed(t.seed, step, 2 + 1000 * i),
                                      temperature=t.eval_temperature, top_p=t.eval_top_p)
            per_prompt = rewards.view(-1, t.eval_samples)
            prefix = f"eval/{name}/" if name else "eval/"
            out[prefix + "reward"] = float(per_prompt.mean())
            out[prefix + f"pass@{t.eval_samples}"] = float((per_prompt.max(dim=1).values > 0).float().mean())
        if "eval/reward" not in out:
            out["eval/reward"] = sum(v for k, v in out.items() if k.endswith("/reward")) / len(self.data.evals)
        return out

    def collect(self, step: int) -> tuple[list[RolloutSample], torch.Tensor, int, dict]:
        """The step's groups and their rewards: prompts_per_step prompts x rollout.n samples, rewards shaped by the
        overlong penalty; with train.filter_groups, only groups whose rewards differ (the others add no gradient),
        refilled by further rollouts (train.refill) up to train.max_rollout_rounds, then topped up with dropped
        groups (placed last). Also how many samples are informative (the rest: top-up, kept out of the loss and
        its normaliser) and (rollout/*) rounds, dropped groups and the mean reward of everything sampled."""
        t, r = self.cfg.train, self.cfg.rollout
        kept, dropped, sampled, rounds = [], [], [], 0
        while True:
            prompts = self.sample_prompts(t.prompts_per_step, step_seed(t.seed, step, 1 + 10 * rounds))
            samples, rewards = self.rollout(prompts, r.n, step_seed(t.seed, step, 10 * rounds))
            rounds += 1
            if r.overlong == "penalty":
                lengths = torch.tensor([len(s.response_ids) for s in samples])
                rewards = rewards + overlong_penalty(lengths, r.max_new_tokens, r.overlong_buffer,
                                                     r.overlong_penalty_factor)
            sampled.append(rewards)
            keep = informative_groups(rewards, r.n) if t.filter_groups != "none" else torch.ones(len(prompts.problems),
                                                                                                dtype=torch.bool)
            for g, ok in enumerate(keep.tolist()):
                (kept if ok else dropped).append((samples[g * r.n : (g + 1) * r.n], rewards[g * r.n : (g + 1) * r.n]))
            if not t.refill or len(kept) >= t.prompts_per_step or rounds >= t.max_rollout_rounds:
                break
        stats = {"rollout/rounds": rounds, "rollout/groups_dropped": len(dropped),
                 "train/reward": float(torch.cat(sampled).mean())}
        groups = (kept + dropped)[: t.prompts_per_step] if t.refill else kept
        samples = [s for g, _ in groups for s in g]
        n_kept = min(len(kept), len(groups))  # the informative groups come first
        stats["rollout/topup_groups"] = len(groups) - n_kept
        return samples, torch.cat([rw for _, rw in groups]) if groups else torch.zeros(0), n_kept * r.n, stats


def training_batch(cfg: Config, samples: list[RolloutSample], advantages: torch.Tensor, *, pad_id: int,
                   in_loss: list[bool] | None = None) -> Batch:
    """The training batch of samples (CPU tensors). Responses cut at max_new_tokens leave the loss with
    rollout.overlong mask, as do samples with in_loss False."""
    m = cfg.model
    cut = cfg.rollout.overlong == "mask"
    in_loss = [(in_loss is None or in_loss[i]) and not (cut and s.finish_reason == "length")
               for i, s in enumerate(samples)]
    return rollout_batch(samples, advantages, pad_id=pad_id, multiple=cfg.parallel.tensor, vocab_size=m.vocab_size,
                         routed_experts=(m.num_layers, m.moe_router_topk) if cfg.rollout.routed_experts else None,
                         in_loss=in_loss)


def step_batches(cfg: Config, samples: list[RolloutSample], rewards: torch.Tensor, informative: int, *,
                 dp_rank: int, dp: int, pad_id: int, device: torch.device) -> list[tuple[Batch, list[int]]]:
    """This DP rank's share of each minibatch of the step (on `device`, one host-to-device copy per tensor) with its
    micro-batch sizes: GRPO-style advantages over the groups, then token-balanced minibatches (train.minibatches,
    micro_batch_size or max_tokens_per_microbatch). Samples from `informative` on are top-up, out of the loss."""
    advantages = compute_advantages(cfg.objective.advantage, rewards, cfg.rollout.n,
                                    eps=cfg.objective.advantage_std_eps)
    plans = plan_minibatches([len(s.prompt_ids) + len(s.response_ids) for s in samples],
                             minibatches=cfg.train.minibatches, ranks=dp, micro_batch_size=cfg.train.micro_batch_size,
                             max_tokens=cfg.train.max_tokens_per_microbatch)
    out = []
    for per_rank in plans:
        rows, sizes = per_rank[dp_rank]
        out.append((training_batch(cfg, [samples[i] for i in rows], advantages[rows], pad_id=pad_id,
                                   in_loss=[i < informative for i in rows]).to(device), sizes))
    return out
