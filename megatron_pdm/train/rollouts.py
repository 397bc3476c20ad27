"""The batch side of a step: prompts to rollouts (through the `RolloutEngine` protocol only), rewards, dynamic
sampling, evaluation, and the step's samples to each rank's training micro-batches with their advantages.

Rank 0 owns the engine and scores every sample once. Every rank gets the rewards and the sequence lengths (one
[N, 3] broadcast), so every rank plans the same minibatches; then rank 0 builds each DP rank's share as tensors and
sends it to the first rank of that DP replica, which broadcasts it over the replica (`step_batches`): a rank
receives 1 / DP of the rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from megatron_pdm._bytes import broadcast_tensors, nbytes, recv_tensors, send_tensors
from megatron_pdm._userfn import load_function
from megatron_pdm.models import ParallelContext
from megatron_pdm.objectives import compute_advantages
from megatron_pdm.rollout import RolloutEngine, RolloutSample, SamplingParams
from megatron_pdm.rollout.multi_turn import GenerateContext, multi_turn

from .batch import (
    Batch,
    batch_from_tensors,
    batch_tensors,
    informative_groups,
    overlong_penalty,
    plan_minibatches,
    rollout_batch,
)
from .config import Config
from .data import PromptSet, RLData, load_reward, sample_name, score
from .remote_reward import RemoteReward, is_remote


def step_seed(seed: int, step: int, salt: int) -> int:
    """The seed of one draw at one step: prompts and rollouts are a function of (train.seed, step) alone, so a
    resumed run, at any layout, draws what the uninterrupted run drew."""
    return (seed * 1_000_003 + step * 7919 + salt) % (2**62)


class Rollouts:
    """Prompts, rollouts and rewards on every rank; `engine` is the rollout engine on rank 0 (None elsewhere).
    device: where collectives run (NCCL takes CUDA tensors only)."""

    def __init__(self, cfg: Config, data: RLData, engine: RolloutEngine | None, device: torch.device):
        self.cfg, self.data, self.engine, self.device = cfg, data, engine, device
        self.tokenizer = data.tokenizer
        d = cfg.data
        self.reward_fn = None if engine is None else (  # scored once, on rank 0
            RemoteReward(d.reward, concurrency=d.reward_concurrency, retries=d.reward_retries,
                         timeout_s=d.reward_timeout_s) if is_remote(d.reward) else load_reward(d.reward))
        r = cfg.rollout
        self.generate_fn = self.tool_fn = None
        if engine is not None and r.generate_fn is not None:
            self.generate_fn = load_function(r.generate_fn, "rollout.generate_fn")
        if engine is not None and r.tool_fn is not None:
            self.tool_fn = load_function(r.tool_fn, "rollout.tool_fn")
            self.generate_fn = self.tool_turns

    def sample_prompts(self, count: int, seed: int) -> PromptSet:
        """`count` training prompts drawn uniformly with replacement (the same on every rank for the same seed)."""
        train = self.data.train
        idx = torch.randint(0, len(train.problems), (count,), generator=torch.Generator().manual_seed(seed)).tolist()
        return PromptSet([train.problems[i] for i in idx], [train.prompt_ids[i] for i in idx])

    def params(self, n: int, seed: int, *, max_new_tokens: int | None = None, temperature: float | None = None,
               top_p: float | None = None, partial: bool = False) -> SamplingParams:
        """The sampling parameters of the run's rollouts (evaluation passes its own temperature and top_p)."""
        r = self.cfg.rollout
        return SamplingParams(max_new_tokens=max_new_tokens or r.max_new_tokens, n=n,
                              temperature=temperature or r.temperature, top_k_logprobs=self.cfg.objective.top_k,
                              stop_token_ids=self.tokenizer.stop_ids, seed=seed,
                              top_p=r.top_p if top_p is None else top_p, top_k=r.top_k,
                              return_routed_experts=r.routed_experts, partial=partial)

    def score(self, samples: list[RolloutSample], problems: list) -> torch.Tensor:
        """Rank 0: each sample's reward (float32) against its problem (problems[i] for samples[i]); a remote reward
        scores them reward_concurrency at a time."""
        responses = [self.tokenizer.decode(s.response_ids.tolist()) for s in samples]
        if isinstance(self.reward_fn, RemoteReward):
            return torch.tensor(self.reward_fn.batch(
                [{"prompt": p.prompt, "response": r, "label": p.answer, "metadata": p.metadata}
                 for r, p in zip(responses, problems, strict=True)],
                [sample_name(r, p, i) for i, (r, p) in enumerate(zip(responses, problems, strict=True))]),
                dtype=torch.float32)
        return torch.tensor([score(self.reward_fn, r, problem, i)
                             for i, (r, problem) in enumerate(zip(responses, problems, strict=True))],
                            dtype=torch.float32)

    def shaped(self, rewards: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Training rewards with DAPO's overlong penalty on the response lengths (lengths[:, 1]) under
        rollout.overlong penalty; as they are otherwise (evaluation never shapes)."""
        r = self.cfg.rollout
        if r.overlong != "penalty":
            return rewards
        return rewards + overlong_penalty(lengths[:, 1], r.max_new_tokens, r.overlong_buffer, r.overlong_penalty_factor)

    def sample(self, prompts: PromptSet, n: int, seed: int, *, temperature: float | None = None,
               top_p: float | None = None) -> tuple[list[RolloutSample], torch.Tensor, torch.Tensor]:
        """Rank 0: n samples per prompt from the engine, their rewards (float32) and [N, 2] (prompt, response)
        lengths. No collective, so a producer thread may call it."""
        params = self.params(n, seed, temperature=temperature, top_p=top_p)
        if self.generate_fn is None:
            samples = self.engine.generate(prompts.prompt_ids, params)
        else:
            samples = self.generate(prompts, params)
        return samples, self.score(samples, [prompts.problems[s.prompt_index] for s in samples]), lengths_of(samples)

    def context(self, problems: list) -> GenerateContext:
        return GenerateContext(self.tokenizer, self.cfg.rollout.max_turns, dict(self.cfg.data.chat_template_kwargs),
                               problems)

    def reply(self, sample: RolloutSample, problem, ctx: GenerateContext) -> list[int] | None:
        """rollout.tool_fn's reply to a sample whose policy turn stopped (None: that turn was the last), checked. A
        turn that stopped on another stop token than EOS (Qwen3's <|endoftext|>) ends the conversation: a tool turn
        after it would not be the template's."""
        if int(sample.response_ids[-1]) != self.tokenizer.eos_id:
            return None
        ids = self.tool_fn(sample, problem, ctx)
        if ids is not None and (not isinstance(ids, list | tuple) or not all(isinstance(i, int) and
                                                                                0 <= i < self.tokenizer.vocab_size
                                                                                for i in ids)):
            raise ValueError(f"rollout.tool_fn {self.cfg.rollout.tool_fn!r}: expected None or a list of token ids "
                             f"in [0, {self.tokenizer.vocab_size}), got {str(ids)[:80]}")
        return ids

    def tool_turns(self, engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams,
                   ctx: GenerateContext) -> list[RolloutSample]:
        """The built-in generate of rollout.tool_fn: `multi_turn` with its replies."""
        return multi_turn(engine, prompts, params, lambda s: self.reply(s, ctx.problems[s.prompt_index], ctx),
                          max_turns=ctx.max_turns)

    def generate(self, prompts: PromptSet, params: SamplingParams) -> list[RolloutSample]:
        """rollout.generate_fn's samples (or the tool loop's), checked: params.n per prompt in `generate`'s order,
        every per-token field one row per token, at most max_new_tokens tokens (the budget the batch is planned
        for)."""
        samples = self.generate_fn(self.engine, prompts.prompt_ids, params, self.context(prompts.problems))
        r = self.cfg.rollout
        where = f"rollout.tool_fn {r.tool_fn!r}" if self.tool_fn else f"rollout.generate_fn {r.generate_fn!r}"
        if not isinstance(samples, list) or len(samples) != len(prompts.prompt_ids) * params.n:
            raise ValueError(f"{where}: expected a list of {len(prompts.prompt_ids) * params.n} samples "
                             f"({params.n} per prompt), got {type(samples).__name__} of {len(samples)}"
                             if isinstance(samples, list) else f"{where}: returned {type(samples).__name__}")
        for i, s in enumerate(samples):
            p = i // params.n
            if not isinstance(s, RolloutSample):
                raise ValueError(f"{where}: sample {i} is a {type(s).__name__}, not a RolloutSample")
            if s.prompt_index != p or s.prompt_ids != prompts.prompt_ids[p]:
                raise ValueError(f"{where}: sample {i} should be of prompt {p} ({params.n} per prompt, in order), "
                                 f"but has prompt_index {s.prompt_index} and {len(s.prompt_ids)} prompt tokens")
            if len(s.response_ids) > params.max_new_tokens:
                raise ValueError(f"{where}: sample {i} has {len(s.response_ids)} response tokens, more than "
                                 f"rollout.max_new_tokens = {params.max_new_tokens}")
            s.check()
        return samples

    def rollout(self, prompts: PromptSet, n: int, seed: int, *, temperature: float | None = None,
                top_p: float | None = None) -> tuple[list[RolloutSample] | None, torch.Tensor, torch.Tensor]:
        """`sample` on rank 0 (None on the other ranks), and on every rank the rewards and lengths: one [N, 3]
        float64 broadcast (exact for lengths below 2**53)."""
        samples, out = None, torch.empty(len(prompts.prompt_ids) * n, 3, dtype=torch.float64, device=self.device)
        if self.engine is not None:
            samples, rewards, lengths = self.sample(prompts, n, seed, temperature=temperature, top_p=top_p)
            out.copy_(torch.cat([rewards[:, None].double(), lengths.double()], dim=1))
        dist.broadcast(out, src=0)
        out = out.cpu()
        return samples, out[:, 0].float(), out[:, 1:].long()

    def share(self, samples: list[RolloutSample] | None) -> list[RolloutSample]:
        """Rank 0's samples on every rank (one pickled broadcast of everything: for analyses, not for training)."""
        box = [samples]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def evaluate(self, step: int) -> dict:
        """eval/reward (avg@k: the mean reward of train.eval_samples responses per prompt) and eval/pass@k, per
        evaluation set as eval/<name>/...; eval/reward is then the mean over the sets."""
        t, out = self.cfg.train, {}
        for i, (name, prompts) in enumerate(self.data.evals.items()):
            _, rewards, _ = self.rollout(prompts, t.eval_samples, step_seed(t.seed, step, 2 + 1000 * i),
                                         temperature=t.eval_temperature, top_p=t.eval_top_p)
            per_prompt = rewards.view(-1, t.eval_samples)
            prefix = f"eval/{name}/" if name else "eval/"
            out[prefix + "reward"] = float(per_prompt.mean())
            out[prefix + f"pass@{t.eval_samples}"] = float((per_prompt.max(dim=1).values > 0).float().mean())
        if "eval/reward" not in out:
            out["eval/reward"] = sum(v for k, v in out.items() if k.endswith("/reward")) / len(self.data.evals)
        return out

    def produce(self, step: int) -> Produced:
        """Rank 0: the step's groups and their rewards: prompts_per_step prompts x rollout.n samples, rewards shaped by
        the overlong penalty; with train.filter_groups, only groups whose rewards differ (the others add no
        gradient), refilled by further rollouts (train.refill) up to train.max_rollout_rounds, then topped up with
        dropped groups (placed last). Prompts and sampling seeds are a function of (train.seed, step): the same
        batch whenever it is produced. No collective: the lagged schedule's producer thread runs it."""
        t, r = self.cfg.train, self.cfg.rollout
        kept, dropped, sampled, rounds, turns = [], [], [], 0, []
        while True:
            prompts = self.sample_prompts(t.prompts_per_step, step_seed(t.seed, step, 1 + 10 * rounds))
            samples, rewards, lengths = self.sample(prompts, r.n, step_seed(t.seed, step, 10 * rounds))
            rounds += 1
            rewards = self.shaped(rewards, lengths)
            sampled.append(rewards)
            turns += [smp.turns() for smp in samples]
            keep = informative_groups(rewards, r.n) if t.filter_groups != "none" else torch.ones(len(prompts.problems),
                                                                                                dtype=torch.bool)
            for g, ok in enumerate(keep.tolist()):
                rows = slice(g * r.n, (g + 1) * r.n)
                (kept if ok else dropped).append((samples[rows], rewards[rows], lengths[rows]))
            if not t.refill or len(kept) >= t.prompts_per_step or rounds >= t.max_rollout_rounds:
                break
        stats = {"rollout/rounds": rounds, "rollout/groups_dropped": len(dropped),
                 "train/reward": float(torch.cat(sampled).mean())}
        if r.generate_fn is not None or r.tool_fn is not None:
            stats["rollout/turns"] = sum(turns) / len(turns)  # the policy's turns per response
        groups = (kept + dropped)[: t.prompts_per_step] if t.refill else kept
        n_kept = min(len(kept), len(groups))  # the informative groups come first
        stats["rollout/topup_groups"] = len(groups) - n_kept
        return Produced(step, [s for g, _, _ in groups for s in g],
                        torch.cat([rw for _, rw, _ in groups]) if groups else torch.zeros(0),
                        torch.cat([ln for _, _, ln in groups]) if groups else torch.zeros(0, 2, dtype=torch.long),
                        n_kept * r.n, stats)

    def publish(self, produced: Produced | None) -> tuple[list[RolloutSample] | None, torch.Tensor, torch.Tensor,
                                                         int, dict]:
        """Collective: rank 0's produced batch to every rank as (samples on rank 0, None elsewhere; rewards; [N, 2]
        lengths; how many samples are informative, the rest top-up, kept out of the loss and its normaliser; its
        rollout/* stats): one pickled broadcast of the rewards, lengths and stats."""
        box = [None if produced is None else (produced.rewards, produced.lengths, produced.informative,
                                              produced.stats)]
        dist.broadcast_object_list(box, src=0, device=self.device)
        rewards, lengths, informative, stats = box[0]
        return (None if produced is None else produced.samples), rewards, lengths, informative, stats


@dataclass
class Produced:
    """One step's rollouts as rank 0 produced them: the samples of the kept groups, their rewards [N] and (prompt,
    response) lengths [N, 2], how many are informative (the first ones), and rollout/* stats."""

    step: int
    samples: list[RolloutSample]
    rewards: torch.Tensor
    lengths: torch.Tensor
    informative: int
    stats: dict

    def state(self) -> dict:
        """Plain tensors, numbers and strings (a checkpoint loads them with torch.load(weights_only=True))."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "stats": dict(self.stats),
                "samples": [smp.state() for smp in self.samples]}

    @classmethod
    def from_state(cls, state: dict) -> Produced:
        return cls(**{**state, "samples": [RolloutSample(**s) for s in state["samples"]]})


def lengths_of(samples: list[RolloutSample]) -> torch.Tensor:
    """[N, 2] long: each sample's (prompt, response) length."""
    return torch.tensor([[len(s.prompt_ids), len(s.response_ids)] for s in samples], dtype=torch.long).reshape(-1, 2)


def training_batch(cfg: Config, samples: list[RolloutSample], advantages: torch.Tensor, *, pad_id: int,
                   in_loss: list[bool] | None = None, version: int | None = None) -> Batch:
    """The training batch of samples (CPU tensors). Responses cut at max_new_tokens leave the loss with
    rollout.overlong mask, as do samples with in_loss False. version: the trainer's weight version, which gives
    every token its age (off-policy schedules; tokens older than objective.max_token_age leave the loss)."""
    m = cfg.model
    cut = cfg.rollout.overlong == "mask"
    in_loss = [(in_loss is None or in_loss[i]) and not (cut and s.finish_reason == "length")
               for i, s in enumerate(samples)]
    return rollout_batch(samples, advantages, pad_id=pad_id, multiple=cfg.parallel.sequence_multiple,
                         vocab_size=m.vocab_size, in_loss=in_loss, version=version,
                         max_age=cfg.objective.max_token_age,
                         routed_experts=(m.num_layers, m.moe_router_topk) if cfg.rollout.routed_experts else None)


def _outgoing(batch: Batch) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors a batch travels as (contiguous; routed experts as int16) and its host fields."""
    tensors, host = batch_tensors(batch)
    return {k: _wire(k, t).contiguous() for k, t in tensors.items()}, host


def _arrived(tensors: dict[str, torch.Tensor], host: dict) -> Batch:
    """The batch of received tensors (routed experts stay int16: the replay widens each micro-batch's slice)."""
    return batch_from_tensors(tensors, host)


def _wire(name: str, t: torch.Tensor) -> torch.Tensor:
    """Expert ids travel as int16 (any expert count below 32,768): a quarter of the int64 bytes of [B, S, layers,
    top_k] routed experts."""
    return t.to(torch.int16) if name == "routed_experts" else t


def _send_batch(batch: Batch, dst: int, device: torch.device) -> int:
    """Send a host-built batch to rank dst by the tensor mail, each tensor through `device`. Returns the bytes."""
    tensors, host = _outgoing(batch)
    return send_tensors(tensors, dst, staging=device, extra=host, device=device)


def _recv_batch(src: int, device: torch.device) -> tuple[Batch, int]:
    tensors, host = recv_tensors(src, device=device)
    return _arrived(tensors, host), nbytes(tensors)


def _broadcast_batch(batch: Batch | None, src: int, group, device: torch.device) -> tuple[Batch, int]:
    """`batch` (held by global rank src, on `device`) to every rank of `group` by the tensor mail. Returns the batch
    and the bytes broadcast."""
    tensors, host = _outgoing(batch) if batch is not None else (None, None)
    tensors, host = broadcast_tensors(tensors, src, group, device=device, extra=host)
    return (batch if batch is not None else _arrived(tensors, host)), nbytes(tensors)


def step_batches(cfg: Config, samples: list[RolloutSample] | None, rewards: torch.Tensor, lengths: torch.Tensor,
                 informative: int, parallel: ParallelContext, *, pad_id: int, device: torch.device,
                 version: int | None = None
                 ) -> tuple[list[tuple[Batch, list[int]]], int]:
    """This DP rank's share of each minibatch of the step, on `device` (routed experts: of this rank's MoE layers
    only, `Batch.with_routed_layers`), with its micro-batch sizes; and the bytes
    this rank received. GRPO-style advantages over the groups and token-balanced minibatches (train.minibatches,
    micro_batch_size or max_tokens_per_microbatch) are computed on every rank from the rewards and lengths.
    Two-level fan-out: rank 0 (which holds `samples`) builds each DP rank's share and sends it to the first rank
    of that replica (`parallel.replicas[d]`: the global ranks of DP rank d, TP x PP x CP of them), which broadcasts
    it over the replica (`parallel.replica_group`; None for a one-rank replica). Rank 0 so sends each share once, not
    once per rank of its replica. Samples from `informative` on are top-up, out of the loss. version: the trainer's
    weight version, for the tokens' ages (`training_batch`; None under the sync schedule, where every age is 0)."""
    advantages = compute_advantages(cfg.objective.advantage, rewards, cfg.rollout.n,
                                    eps=cfg.objective.advantage_std_eps)
    plans = plan_minibatches(lengths.sum(dim=1).tolist(), minibatches=cfg.train.minibatches, ranks=parallel.dp,
                             micro_batch_size=cfg.train.micro_batch_size,
                             max_tokens=cfg.train.max_tokens_per_microbatch, per_rank=cfg.min_micro_batches)
    out, received, moe = [], 0, parallel.moe_layers(cfg.model)
    dp_rank, replicas, group = parallel.dp_rank, parallel.replicas, parallel.replica_group
    leader = replicas[dp_rank][0]
    for per_rank in plans:
        mine = None
        if samples is not None:  # rank 0: build every share, send it to its replica's first rank, keep its own
            for d, (rows, _) in enumerate(per_rank):
                share = training_batch(cfg, [samples[i] for i in rows], advantages[rows], pad_id=pad_id,
                                       in_loss=[i < informative for i in rows], version=version)
                if d == dp_rank:
                    mine = share.to(device)
                else:
                    _send_batch(share, replicas[d][0], device)
        elif dist.get_rank() == leader:
            mine, nbytes = _recv_batch(0, device)
            received += nbytes
        if group is not None:  # the replica's first rank passes its share on
            mine, nbytes = _broadcast_batch(mine, leader, group, device)
            received += nbytes if dist.get_rank() != leader else 0
        out.append((mine.with_routed_layers(moe), per_rank[dp_rank][1]))  # this rank's MoE layers' choices
    return out, received
