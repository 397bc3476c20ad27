"""Which weights generate each step's rollouts (`rollout.schedule`), apart from how the work is overlapped.

sync: step s trains on rollouts of version s, the weights it starts from (generate, then train).

lagged, lag k: step s trains on rollouts of version max(s - k, 0) (k = 1: one-step-off, slime's train_async and
verl's one_step_off). Batches s..s+k-1 wait in a FIFO; when step s takes batch s, batch s + k is produced from the
engine's current weights, version s, while the step trains. Every token of batch s has age min(s, k), and no
generation spans two versions.

streaming, max_staleness k (Kimi k1.5's partial rollouts with AReaL's admission rule): groups (one prompt, n
samples) are admitted in order while admitted < (k + v + 1) x prompts_per_step at engine version v, and each round
advances every unfinished sample by `rollout.segment_tokens` (a sample cut at a round's end is continued, prefix
prefilled again, under the next round's weights: `RolloutEngine.extend`, with `rollout.partial`; without it every
sample is generated whole in the round that admits it). One round runs per step, at the step's version, while it
trains; step s takes the prompts_per_step oldest groups, in admission order, running further rounds first (the
trainer waits) while any of them is unfinished. A group admitted at version v has index < (k + v + 1) P and is
trained at step index // P <= k + v, so no token is older than k versions. Samples may span versions
(`RolloutSample.token_versions`).

In every schedule which version generates a token is a function of (train.seed, step) alone: prompts and sampling
seeds are (`Rollouts.produce`, group indices), and the rounds above are fixed, so the producer thread
(`rollout.overlap`; without it the same work runs after each step, before its weight sync) cannot change a
sample. The engine's weights change only between steps, after the producer finished (`settle`). What waits
(batches, groups, partial samples) is saved with each checkpoint (`state`; rank 0), so that a resumed run trains
on what the uninterrupted one trained on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields

import torch

from megatron_pdm.rollout import RolloutSample

from .batch import overlong_penalty
from .config import Config
from .rollouts import Produced, Rollouts, lengths_of, step_seed

log = logging.getLogger(__name__)
PENDING_FILE = "pending_rollouts.pt"  # in a checkpoint directory, beside the trainer state


def build_schedule(cfg: Config, rollouts: Rollouts):
    """The schedule `rollout.schedule` names (sync is lagged with lag 0)."""
    r = cfg.rollout
    if r.schedule == "streaming":
        return StreamingSchedule(rollouts, cfg)
    return LaggedSchedule(rollouts, lag=cfg.lag, overlap=r.overlap, steps=cfg.train.steps)


def age_stats(samples: list[RolloutSample], version: int) -> dict:
    """rollout/token_age_mean / max (over response tokens; age = version - the token's version) and
    rollout/mixed_version_frac (samples whose tokens come from more than one version)."""
    versions = [s.versions() for s in samples]
    ages = [version - v for v in versions if len(v)]
    return {"rollout/token_age_mean": float(sum(int(a.sum()) for a in ages) / max(sum(len(a) for a in ages), 1)),
            "rollout/token_age_max": max((int(a.max()) for a in ages), default=0),
            "rollout/mixed_version_frac": sum(len(set(v.tolist())) > 1 for v in versions) / max(len(versions), 1)}


class _Producer:
    """The producer half of a schedule on rank 0: `work` runs on a thread while the step trains (overlap) or at
    `settle` (no overlap); `settle` waits for it. The other ranks only take what rank 0 publishes."""

    def __init__(self, rollouts: Rollouts, *, overlap: bool, threaded: bool):
        self.rollouts = rollouts
        self.producing = rollouts.engine is not None
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="rollout-producer") \
            if self.producing and overlap and threaded else None
        self.next: Future | tuple | None = None  # the work running, or (function, args) to run at `settle`
        self.wait_s = 0.0  # the trainer's wait for rollouts since the last `take`

    def launch(self, fn, *args) -> None:
        self.next = self.thread.submit(fn, *args) if self.thread else (fn, args)

    def finish(self):
        """Wait for the launched work (before any weight update: no generation spans two versions) and return its
        result; adds the wait to `wait_s`."""
        if self.next is None:
            return None
        t0, work, self.next = time.perf_counter(), self.next, None
        out = work.result() if isinstance(work, Future) else work[0](*work[1])
        self.wait_s += time.perf_counter() - t0
        return out

    def close(self) -> None:
        if self.thread is not None:
            self.thread.shutdown(wait=True, cancel_futures=True)


class LaggedSchedule(_Producer):
    """sync (lag 0) and lagged: the FIFO of produced batches."""

    def __init__(self, rollouts: Rollouts, *, lag: int, overlap: bool, steps: int):
        super().__init__(rollouts, overlap=overlap, threaded=lag > 0)
        self.lag, self.steps = lag, steps
        self.fifo: deque[Produced] = deque()

    def start(self, step: int, state: list[dict] | None = None) -> None:
        """Before step `step` (the engine at version `step`): the FIFO of batches step..step+lag-1, the pending ones
        of the checkpoint resumed from, the rest produced now."""
        if not self.producing:
            return
        self.fifo = deque(p for p in map(Produced.from_state, state or []) if step <= p.step < step + self.lag)
        if [p.step for p in self.fifo] != list(range(step, step + len(self.fifo))):
            raise ValueError(f"pending rollouts: steps {[p.step for p in self.fifo]} do not follow step {step}")
        if step and len(self.fifo) < min(self.lag, self.steps - step):
            log.warning("resuming a lagged schedule at step %d with %d of its %d pending batches (the checkpoint was "
                        "written by a shorter run or another schedule): the others are generated now, from version %d",
                        step, len(self.fifo), self.lag, step)
        for s in range(step + len(self.fifo), min(step + self.lag, self.steps)):
            self.fifo.append(self.rollouts.produce(s))

    def take(self, step: int) -> tuple:
        """Collective: step `step`'s batch on every rank (`Rollouts.publish`) with `age_stats` (ages against version
        `step`); starts the production of batch step + lag."""
        produced, t0 = None, time.perf_counter()
        if self.producing:
            produced = self.fifo.popleft() if self.lag else self.rollouts.produce(step)
            if produced.step != step:
                raise RuntimeError(f"rollout schedule: step {step} got the batch of step {produced.step}")
            if self.lag and step + self.lag < self.steps:
                self.launch(self.rollouts.produce, step + self.lag)
            produced.stats.update(age_stats(produced.samples, step))
        self.wait_s = time.perf_counter() - t0  # sync: the whole generation; lagged: none
        return self.rollouts.publish(produced)

    def settle(self) -> None:
        produced = self.finish()
        if produced is not None:
            self.fifo.append(produced)

    def state(self) -> list[dict] | None:
        """The pending batches (after `settle`), for a checkpoint; None off rank 0 and under the sync schedule."""
        return [p.state() for p in self.fifo] if self.producing and self.lag else None


@dataclass
class Group:
    """One admitted prompt and its n samples (partial ones finish "abort"), and their rewards once all finished."""

    index: int  # admission order
    problem: int  # the training problem's index
    samples: list[RolloutSample]
    rewards: torch.Tensor | None = None

    def state(self) -> dict:
        return {"index": self.index, "problem": self.problem, "rewards": self.rewards,
                "samples": [{f.name: getattr(s, f.name) for f in fields(s)} for s in self.samples]}

    @classmethod
    def from_state(cls, d: dict) -> Group:
        return cls(d["index"], d["problem"], [RolloutSample(**s) for s in d["samples"]], d["rewards"])


class StreamingSchedule(_Producer):
    """streaming: the buffer of admitted groups in admission order, advanced one round per step."""

    def __init__(self, rollouts: Rollouts, cfg: Config):
        super().__init__(rollouts, overlap=cfg.rollout.overlap, threaded=True)
        r, t = cfg.rollout, cfg.train
        self.max_staleness, self.n, self.per_step, self.steps = r.max_staleness, r.n, t.prompts_per_step, t.steps
        self.max_new, self.seed = r.max_new_tokens, t.seed
        self.segment = r.segment_tokens if r.partial else r.max_new_tokens
        self.overlong = (r.overlong, r.overlong_buffer, r.overlong_penalty_factor)
        self.groups: deque[Group] = deque()
        self.admitted = self.version = 0

    def start(self, step: int, state: dict | None = None) -> None:
        """Before step `step`: the buffer of the checkpoint resumed from (none: every group before this step's was
        trained)."""
        self.version = step
        if state is not None:
            self.admitted, self.groups = state["admitted"], deque(map(Group.from_state, state["groups"]))
        else:
            self.admitted = step * self.per_step

    def _cut(self, samples: list[RolloutSample]) -> None:
        """Samples stopped by the round's budget before max_new_tokens are partial ("abort")."""
        for s in samples:
            if s.finish_reason == "length" and len(s.response_ids) < self.max_new:
                s.finish_reason = "abort"

    def round(self) -> None:
        """One round at the engine's version: every partial sample advances by a segment (samples of one length in
        one `extend`), then groups are admitted up to the capacity and generate their first segment; groups whose
        samples all finished are scored."""
        ro, engine = self.rollouts, self.rollouts.engine
        partial = [s for g in self.groups for s in g.samples if s.finish_reason == "abort"]
        continued = {}
        for length in sorted({len(s.response_ids) for s in partial}):
            same = [s for s in partial if len(s.response_ids) == length]
            done = engine.extend(same, ro.params(1, 0, max_new_tokens=min(length + self.segment, self.max_new)))
            self._cut(done)
            continued.update(zip(map(id, same), done, strict=True))
        for g in self.groups:
            g.samples = [continued.get(id(s), s) for s in g.samples]
        new = max(0, (self.max_staleness + self.version + 1) * self.per_step - self.admitted)
        if new:
            train = ro.data.train
            problems = [int(torch.randint(0, len(train.problems), (), generator=torch.Generator().manual_seed(
                step_seed(self.seed, g, 4)))) for g in range(self.admitted, self.admitted + new)]
            samples = engine.generate([train.prompt_ids[i] for i in problems], ro.params(
                self.n, step_seed(self.seed, self.admitted, 3), max_new_tokens=self.segment))
            self._cut(samples)
            self.groups.extend(Group(self.admitted + j, p, samples[j * self.n:(j + 1) * self.n])
                               for j, p in enumerate(problems))
            self.admitted += new
        for g in self.groups:
            if g.rewards is None and all(s.finish_reason != "abort" for s in g.samples):
                g.rewards = self._rewards(g)

    def _rewards(self, g: Group) -> torch.Tensor:
        rewards = self.rollouts.score(g.samples, [self.rollouts.data.train.problems[g.problem]] * len(g.samples))
        how, buffer, factor = self.overlong
        if how == "penalty":
            rewards = rewards + overlong_penalty(lengths_of(g.samples)[:, 1], self.max_new, buffer, factor)
        return rewards

    def take(self, step: int) -> tuple:
        """Collective: the prompts_per_step oldest groups on every rank (`Rollouts.publish`), rounds run first while
        any is unfinished (the trainer waits); then the round of this step's version starts."""
        produced, t0 = None, time.perf_counter()
        self.version = step
        if self.producing:
            waited = 0
            while len(self.groups) < self.per_step or any(g.rewards is None for g in
                                                          list(self.groups)[: self.per_step]):
                self.round()
                waited += 1
            groups = [self.groups.popleft() for _ in range(self.per_step)]
            samples = [s for g in groups for s in g.samples]
            rewards = torch.cat([g.rewards for g in groups])
            stats = {"rollout/wait_rounds": waited, "train/reward": float(rewards.mean()),
                     "rollout/buffer_groups": len(self.groups),
                     "rollout/partial_samples": sum(s.finish_reason == "abort" for g in self.groups
                                                    for s in g.samples), **age_stats(samples, step)}
            produced = Produced(step, samples, rewards, lengths_of(samples), len(samples), stats)
            if step + 1 < self.steps:
                self.launch(self.round)
        self.wait_s = time.perf_counter() - t0
        return self.rollouts.publish(produced)

    def settle(self) -> None:
        self.finish()

    def state(self) -> dict | None:
        """The buffer (after `settle`): admitted count and every waiting group with its (partial) samples."""
        if not self.producing:
            return None
        return {"admitted": self.admitted, "groups": [g.state() for g in self.groups]}
