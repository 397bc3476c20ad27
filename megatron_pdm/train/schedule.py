"""Which weights generate each step's rollouts (`rollout.schedule`), apart from how the work is overlapped.

sync: step s trains on rollouts of version s, the weights it starts from (generate, then train).
lagged, lag k: step s trains on rollouts of version max(s - k, 0) (k = 1: one-step-off, slime's train_async and
verl's one_step_off). Batches s..s+k-1 wait in a FIFO; when step s takes batch s, batch s + k is produced from the
engine's current weights, version s, while the step trains (`rollout.overlap`: a thread on rank 0; without it,
after the step, before its weight sync: the same batch). The engine's weights change only between steps, after the
producer finished (`settle`), so no generation spans two versions, and every token of batch s has age
min(s, k). The schedule is a function of (train.seed, step) alone: prompts and sampling seeds are
(`Rollouts.produce`), and which version generates batch s is fixed above, so threads cannot change a sample.

The k pending batches are saved with each checkpoint (`state`; rank 0) so that a resumed run trains on what the
uninterrupted one trained on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from .rollouts import Produced, Rollouts

log = logging.getLogger(__name__)
PENDING_FILE = "pending_rollouts.pt"  # in a checkpoint directory, beside the trainer state


class RolloutSchedule:
    """The FIFO of produced batches and the producer on rank 0; every rank calls `take` (collective), rank 0 alone
    produces. lag 0 is the sync schedule."""

    def __init__(self, rollouts: Rollouts, *, lag: int, overlap: bool, steps: int):
        self.rollouts, self.lag, self.steps = rollouts, lag, steps
        self.producing = rollouts.engine is not None
        self.fifo: deque[Produced] = deque()
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="rollout-producer") \
            if self.producing and lag and overlap else None
        self.next: Future | int | None = None  # the batch being produced: its future, or its step (no overlap)
        self.wait_s = 0.0  # the trainer's wait for rollouts since the last `take`

    def start(self, step: int, pending: list[Produced] | None = None) -> None:
        """Before step `step` (the engine at version `step`): the FIFO of batches step..step+lag-1, the pending ones
        of the checkpoint resumed from, the rest produced now."""
        if not self.producing:
            return
        self.fifo = deque(p for p in pending or [] if step <= p.step < step + self.lag)
        if [p.step for p in self.fifo] != list(range(step, step + len(self.fifo))):
            raise ValueError(f"pending rollouts: steps {[p.step for p in self.fifo]} do not follow step {step}")
        if step and len(self.fifo) < min(self.lag, self.steps - step):
            log.warning("resuming a lagged schedule at step %d with %d of its %d pending batches (the checkpoint was "
                        "written by a shorter run or another schedule): the others are generated now, from version %d",
                        step, len(self.fifo), self.lag, step)
        for s in range(step + len(self.fifo), min(step + self.lag, self.steps)):
            self.fifo.append(self.rollouts.produce(s))

    def take(self, step: int) -> tuple:
        """Collective: step `step`'s batch on every rank (`Rollouts.publish`), with rollout/token_age_mean / max and
        rollout/mixed_version_frac (over its samples' response tokens; ages against version `step`). Starts the
        production of batch step + lag."""
        produced, t0 = None, time.perf_counter()
        if self.producing:
            produced = self.fifo.popleft() if self.lag else self.rollouts.produce(step)
            if produced.step != step:
                raise RuntimeError(f"rollout schedule: step {step} got the batch of step {produced.step}")
            if self.lag and step + self.lag < self.steps:
                self.next = self.thread.submit(self.rollouts.produce, step + self.lag) if self.thread \
                    else step + self.lag
            versions = [s.versions() for s in produced.samples]
            ages = [step - v for v in versions if len(v)]
            produced.stats.update({
                "rollout/token_age_mean": float(sum(int(a.sum()) for a in ages) / max(sum(len(a) for a in ages), 1)),
                "rollout/token_age_max": max((int(a.max()) for a in ages), default=0),
                "rollout/mixed_version_frac": sum(len(set(v.tolist())) > 1 for v in versions) / max(len(versions), 1),
            })
        self.wait_s = time.perf_counter() - t0  # sync: the whole generation; lagged: none
        return self.rollouts.publish(produced)

    def settle(self) -> None:
        """Wait for the batch being produced (rank 0; before any weight update: no generation spans two versions),
        and queue it; adds the wait to `wait_s`."""
        if self.next is None:
            return
        t0 = time.perf_counter()
        self.fifo.append(self.next.result() if isinstance(self.next, Future) else self.rollouts.produce(self.next))
        self.next = None
        self.wait_s += time.perf_counter() - t0

    def state(self) -> list[dict] | None:
        """The pending batches (after `settle`), for a checkpoint; None off rank 0 and under the sync schedule."""
        return [p.state() for p in self.fifo] if self.producing and self.lag else None

    def close(self) -> None:
        if self.thread is not None:
            self.thread.shutdown(wait=True, cancel_futures=True)
