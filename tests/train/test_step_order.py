"""The order of one RL step (`Trainer.train_step`), with fakes of the engine and the Learner in a world of one.

The fakes record what the trainer asks of them and compute nothing, so that a step's order is checked in
milliseconds: the rollouts are generated before any batch is cut; every minibatch is cut before the first update;
the pi_old pass (a correction) runs for every minibatch before the first update; the reference pass (a KL penalty)
runs just before each minibatch's update; the engine takes the new weights once, after the last update, at the next
version; a colocated engine releases its memory before the batches move. The real Learner and engines are tested
against numbers elsewhere (test_train.py, test_sglang.py, ...); these fakes stand in for nothing those tests need.
"""

import math
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from megatron_pdm.objectives import Metrics
from megatron_pdm.rollout import RolloutSample
from megatron_pdm.train.config import config_from_dict
from megatron_pdm.train.data import ARITHMETIC_TOKENIZER
from tests.helpers import TRAIN_DENSE


class FakeEngine:
    """A `RolloutEngine` whose responses are fixed token runs ending in EOS, with a valid top-K (mass 0.5 + 0.4):
    records generate / update_weights / release_memory."""

    def __init__(self, events: list, vocab: int, eos: int):
        self.events, self.vocab, self.eos = events, vocab, eos

    def start(self):
        pass

    def generate(self, prompts, params):
        self.events.append(("generate", len(prompts)))
        K, out = params.top_k_logprobs, []
        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                L = 1 + (i + j) % params.max_new_tokens  # lengths differ: the minibatch plan sees real sizes
                first = [3 + (i + j + t) % 10 for t in range(L - 1)] + [self.eos]
                ids = torch.tensor(first)
                top = torch.stack([(ids + k) % self.vocab for k in range(K)], dim=1)
                lp = torch.full((L, K), math.log(0.4 / max(K - 1, 1)))
                lp[:, 0] = math.log(0.5)
                out.append(RolloutSample(i, list(prompt), ids, lp[:, 0].clone(), top, lp, "stop", 0))
        return out

    def extend(self, samples, params):
        raise AssertionError("no sample is extended under the sync schedule")

    def update_weights(self, weights, version):
        self.events.append(("update_weights", version))

    def release_memory(self):
        self.events.append(("release_memory",))

    def resume_memory(self):
        self.events.append(("resume_memory",))

    def health(self):
        return True

    def close(self):
        pass


class FakeLearner:
    """The Learner's surface the trainer uses; records each call with its micro-batch count."""

    def __init__(self, cfg, device, parallel, events: list):
        self.cfg, self.device, self.parallel, self.events = cfg, device, parallel, events
        self.updates_skipped, self.chunks, self.reference = 0, [], None
        self.optimizer = type("Optimizer", (), {"get_loss_scale": staticmethod(lambda: torch.tensor(1.0))})()

    def micro_batches(self, batch, sizes):
        self.events.append(("micro_batches", len(sizes)))
        return batch.split(sizes)

    def step_start_logprobs(self, mbs):
        self.events.append(("pi_old", len(mbs)))

    def reference_logprobs(self, mbs):
        self.events.append(("pi_ref", len(mbs)))

    def reference_on_device(self, *, writeback=False):
        return nullcontext()

    def update(self, mbs, loss_fn):
        self.events.append(("update", len(mbs)))
        return 1.0, 0.5, Metrics()

    def close(self):
        pass

    def sync_weights(self, engine, version):
        self.events.append(("sync_weights", version))
        if engine is not None:
            engine.update_weights(iter(()), version)


def _cfg(objective=None, rollout=None):
    return config_from_dict({
        "model": {**TRAIN_DENSE, "tokenizer": str(ARITHMETIC_TOKENIZER)}, "objective": objective or {},
        "rollout": {"n": 2, "max_new_tokens": 3, **(rollout or {})}, "data": {"max_operand": 2},
        "train": {"steps": 1, "prompts_per_step": 4, "minibatches": 2, "micro_batch_size": 2, "eval_every": 1,
                  "eval_prompts": 4, "checkpoint_every": 1000, "warm_start_steps": 0}})


def rank_step_events(group, cfg, run_dir):
    from megatron_pdm.train.trainer import Trainer

    events = []
    trainer = None
    try:
        trainer = Trainer(cfg, Path(run_dir), learner=lambda c, d, p: FakeLearner(c, d, p, events),
                          engine=FakeEngine(events, cfg.model.vocab_size, 0))
        trainer.rollouts.engine.eos = trainer.tokenizer.eos_id
        row = trainer.train_step(0)
    finally:
        if trainer is not None:
            trainer.parallel.close()
    return events, row


CASES = {
    "plain": ({}, {}, ["generate", "micro_batches", "micro_batches", "update", "update", "sync_weights",
                       "update_weights"]),
    "correction_and_kl": (dict(correction="tis", kl_coef=0.1), {},
                          ["generate", "micro_batches", "micro_batches", "pi_old", "pi_old", "pi_ref", "update",
                           "pi_ref", "update", "sync_weights", "update_weights"]),
    "colocated": ({}, dict(engine="sglang", release_memory=True),  # the fake engine stands in for the servers
                  ["generate", "release_memory", "micro_batches", "micro_batches", "update", "update", "sync_weights",
                   "update_weights"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_runs_in_order(dist_pools, tmp_path, case):
    objective, rollout, expected = CASES[case]
    ((events, row),) = dist_pools(1).run(rank_step_events, shared=(_cfg(objective, rollout), tmp_path / case))
    assert [e[0] for e in events] == expected, events
    assert ("sync_weights", 1) in events and ("update_weights", 1) in events  # the next version, once
    assert row["step"] == 1 and row["train/loss"] == 1.0  # the fake's loss, averaged over the two minibatches


def rank_failed_start(group, cfg, run_dir):
    from megatron.core import parallel_state

    from megatron_pdm.train.trainer import Trainer

    def learner(*args):
        raise ValueError("the learner could not be built")

    try:
        Trainer(cfg, Path(run_dir), learner=learner, engine=FakeEngine([], cfg.model.vocab_size, 0))
    except ValueError as e:
        return str(e), parallel_state.model_parallel_is_initialized()
    return None, parallel_state.model_parallel_is_initialized()


def test_a_failed_start_closes_its_process_groups(dist_pools, tmp_path):
    """A Trainer whose start fails after the process groups were made closes them before the error leaves it."""
    ((message, initialised),) = dist_pools(1).run(rank_failed_start, shared=(_cfg(), tmp_path))
    assert message == "the learner could not be built" and not initialised
