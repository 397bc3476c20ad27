"""The RL loop: rollout -> reward -> advantages -> masked policy-gradient updates on TP-sharded logits -> weight
sync -> evaluation, checkpoints and logging, on megatron-core over any TP / PP / CP / EP / DP layout.

Every rank runs `Trainer.run`. Who holds what in one step (DESIGN.md 4.4 has the long form):
  rank 0          the engine; `schedule.take`: the step's rollouts and rewards (`Rollouts.produce`, now or, with an
                  off-policy schedule, by the producer thread during earlier steps; train/schedule.py)
  every rank      `Rollouts.publish`: rewards, lengths, stats (one broadcast); advantages and the minibatch plan
  rank 0 -> DP leaders -> replica   each DP rank's share of the batch as tensors (`step_batches`)
  every rank      micro-batches, the pi_old pass (a correction), `Learner.update` per minibatch (train/step.py)
  stage senders -> engine  the weights in buckets (`WeightSync`: each stage's own export shards or weights group,
                  or through rank 0), once the producer settled
  rank 0          the metrics row; every rank: the checkpoint (rank 0 adds the schedule's waiting rollouts)
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_pdm._rundir import RunDir
from megatron_pdm.models import initialize_parallel
from megatron_pdm.models.gpt import te_available
from megatron_pdm.objectives import Metrics, loss_normalizer
from megatron_pdm.rollout import RolloutEngine, build_engine

from .checkpoint import check_run_dir, load_latest, read_rank0_file, save_checkpoint
from .config import Config
from .data import RLData, load_rl_data
from .faults import kill_point
from .init import initialize
from .logging import RunLogger
from .rollouts import Rollouts, step_batches
from .schedule import PENDING_FILE, build_schedule
from .step import Learner

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, data: RLData | None = None, *, learner=Learner,
                 engine: RolloutEngine | None = None):
        """data: the tokenizer and prompts (`load_rl_data(cfg)`, loaded here when not given). Builds the process
        groups (`parallel`, passed down to every part); they outlive `run`: `parallel.close()` ends them.
        learner(cfg, device, parallel) builds the Learner; engine: rank 0's rollout engine, built from
        cfg.rollout and started when not given (tests pass fakes of both to check a step's order)."""
        self.cfg, self.run_dir = cfg, RunDir(run_dir)
        self.data = data if data is not None else load_rl_data(cfg)  # every input error before a model is built
        self.tokenizer = self.data.tokenizer
        self.rank = dist.get_rank()
        cfg.check_world_size(dist.get_world_size(), f"this run's {dist.get_world_size()} ranks")  # --nproc, torchrun
        cfg.precision.check_hardware(cuda=torch.cuda.is_available(), transformer_engine=te_available())
        self.parallel = initialize_parallel(cfg.parallel, seed=cfg.train.seed)  # the process groups, passed down
        try:
            self._build(cfg, learner, engine)
        except BaseException:
            self.parallel.close()  # a failed start leaves no group behind (its replica groups poll with threads)
            raise

    def _build(self, cfg: Config, learner, engine) -> None:
        # the device of the weights, the batches and every collective (NCCL groups take CUDA tensors only)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.learner = learner(cfg, self.device, self.parallel)
        if cfg.distill.enabled:  # from its source, on a fresh start and on resume alike (never checkpointed)
            self.learner.keep_teacher()
        if self.rank != 0:
            engine = None  # the engine lives on rank 0
        elif engine is None:
            engine = build_engine(cfg.rollout, cfg.model, cfg.precision, run_dir=self.run_dir.path,
                                  tokenizer_dir=self.tokenizer.path)
            engine.start()
        self.rollouts = Rollouts(cfg, self.data, engine, self.device)
        self.schedule = build_schedule(cfg, self.rollouts)
        self.pending = None  # what the schedule had waiting in the checkpoint resumed from (rank 0)
        self.logger = RunLogger(self.run_dir.path, cfg, enabled=self.rank == 0)
        self.weight_version = 0
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.async_saves = AsyncCallsQueue() if cfg.train.async_save else None  # megatron's, with train.async_save

    @property
    def chunks(self) -> list:
        """The trained model's chunks on this rank (one per virtual pipeline stage; one without)."""
        return self.learner.chunks

    @property
    def engine(self):
        return self.rollouts.engine

    def initialize(self) -> None:
        initialize(self.cfg, self.learner, self.data, self.device)

    def sync_weights(self, version: int) -> None:
        """The engine takes the current weights as `version` (collective: every rank sends its stage's part), once
        the rollouts it is generating are done."""
        self.schedule.settle()
        self.learner.sync_weights(self.engine, version)
        self.weight_version = version
        kill_point("weight_sync", version, self.rank)

    # -- one RL step ----------------------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        cfg, learner, t0 = self.cfg, self.learner, time.perf_counter()
        samples, rewards, lengths, informative, stats = self.schedule.take(step)
        kill_point("step", step + 1, self.rank)
        out = {"step": step + 1, **stats, "train/updates_skipped": learner.updates_skipped,
               "perf/rollout_s": time.perf_counter() - t0}
        if len(lengths) < self.parallel.dp * cfg.min_micro_batches:  # dynamic sampling dropped (nearly) every group:
            # too few rows to give each rank its micro-batches (PP of them with virtual stages); the engines keep memory
            self.sync_weights(step + 1)  # unchanged weights, but the producer settles and versions follow steps
            return {**out, "train/no_informative_group": 1, "perf/tokens_per_s": 0.0,
                    "perf/step_s": time.perf_counter() - t0}
        if cfg.rollout.releases_memory and self.engine is not None:  # colocated: the trainer takes the GPUs
            self.engine.release_memory()
        minibatches, received = step_batches(cfg, samples, rewards, lengths, informative, self.parallel,
                                             pad_id=self.tokenizer.pad_id, device=self.device,
                                             version=step if cfg.off_policy else None)
        received = torch.tensor([received], dtype=torch.float64, device=self.device)
        dist.all_reduce(received, op=dist.ReduceOp.MAX)  # the most rollout bytes any rank received this step
        # every micro-batch of the step cut before any compute (context shards copy an index to the device)
        minibatches = [(local, learner.micro_batches(local, sizes)) for local, sizes in minibatches]
        for _, mbs in minibatches:  # before the first update: pi_old (a correction)
            if cfg.objective.needs_step_start_pass:
                learner.step_start_logprobs(mbs)
        losses, norms, metrics, computed, empty = [], [], Metrics(), torch.zeros(2, dtype=torch.float64), 0
        t_train = time.perf_counter()
        for local, mbs in minibatches:
            # over the DP rank's whole minibatch (every CP rank of it holds the same), summed over DP
            normalizer = loss_normalizer(local.loss_mask, local.sequence_ids, cfg.objective.aggregation,
                                         group=self.parallel.dp_group)
            positions = sum(mb.rows * mb.width for mb in mbs) * self.parallel.cp  # CP ranks compute S / CP columns each
            computed += torch.tensor([positions, local.real_tokens], dtype=torch.float64)
            if not normalizer.item():  # a host sync per minibatch; the same global count on every rank
                # no loss token on any rank (top-up groups only, every response cut under overlong: mask): no
                # gradient, and no optimizer step either (Adam's moments and weight decay would still move weights)
                empty += 1
                continue
            if cfg.objective.needs_reference:  # pi_ref (a KL penalty; frozen), one minibatch's at a time
                learner.reference_logprobs(mbs)
            if cfg.distill.enabled:  # the teacher's hidden states (and with as_reward its reward), likewise
                learner.teacher_pass(mbs)
            loss, gnorm, m_metrics = learner.update(mbs, lambda mb, z, n=normalizer: learner.rl_loss(mb, z, n))
            for mb in mbs:
                mb.ref_hidden = mb.teacher_hidden = None  # the exact KL's and the teacher's [N, H]: used
            if not losses:  # before any update of this step pi is the weights mu sampled from, up to precision (and
                # the lag: the age splits tell them apart)
                metrics.merge(m_metrics.renamed("mismatch/", "mismatch_start/"))
                metrics.merge(m_metrics.renamed("divergence/age", "divergence_start/age"))  # with ages only
            losses.append(loss)
            norms.append(gnorm)
            metrics.merge(m_metrics)
        t_train = time.perf_counter() - t_train
        if cfg.distill.enabled:
            out["distill/teacher_s"], learner.teacher_s = learner.teacher_s, 0.0
        if self.parallel.dp > 1:  # positions computed and real tokens over the DP ranks: once per step
            computed = computed.to(self.device)
            dist.all_reduce(computed, group=self.parallel.dp_group)
        positions, real = computed.tolist()
        self.sync_weights(step + 1)
        elapsed = time.perf_counter() - t0
        if self.schedule.producing:  # rank 0 waits for the engine; the other ranks wait for rank 0
            out.update({"perf/rollout_wait_s": self.schedule.wait_s, "perf/trainer_idle_frac":
                        self.schedule.wait_s / elapsed})
        tokens = int(lengths[:, 1].sum())
        if losses:  # none when every minibatch was empty
            out.update({"train/loss": sum(losses) / len(losses), "train/grad_norm": sum(norms) / len(norms)})
        if empty:
            out["train/empty_minibatches"] = empty
        out.update({
            "train/response_length": tokens / len(lengths),
            "train/loss_scale": float(learner.optimizer.get_loss_scale()),
            "train/updates_skipped": learner.updates_skipped,
            "perf/tokens_per_s": tokens / elapsed,
            "perf/train_tokens_per_s": real / t_train,
            "perf/padding_frac": 1 - real / positions,
            "perf/rollout_bytes_per_rank": float(received.item()),
            "perf/step_s": elapsed,
        })
        out.update(metrics.reduce(self.parallel.dp_cp_group, device=self.device))  # CP ranks hold different tokens
        return out

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def save(self, step: int) -> None:
        self.finish_saves()  # one checkpoint in flight at a time
        t = self.cfg.train
        with self.learner.reference_on_device():  # an offloaded reference is saved from the device, as the model
            save_checkpoint(self.run_dir.checkpoints, step, self.chunks, self.learner.optimizer, keep_last=t.keep_last,
                            config=self.cfg.to_dict(), tokenizer_dir=self.tokenizer.path, async_queue=self.async_saves,
                            trainer_state={"updates_skipped": self.learner.updates_skipped,
                                           "weight_version": self.weight_version, "seed": t.seed,
                                           "loss_scale": float(self.learner.optimizer.get_loss_scale()),
                                           "parallel": asdict(self.cfg.parallel)},
                            rank0_files={PENDING_FILE: pending} if (pending := self.schedule.state()) else None,
                            reference=self.learner.reference)

    def finish_saves(self, *, blocking: bool = True) -> None:
        """Publish the async checkpoints whose writers finished on every rank (all of them, waiting, if blocking);
        collective, a no-op without train.async_save."""
        if self.async_saves is not None:
            self.async_saves.maybe_finalize_async_calls(blocking=blocking)

    def resume(self) -> int | None:
        """Load the newest checkpoint that loads (`load_latest`: a corrupt one is set aside, a failure of this
        process is an error). Returns its step, or None when there is no checkpoint."""
        if self.cfg.objective.needs_reference:  # chunks to load the reference policy into
            self.learner.keep_reference()
        with self.learner.reference_on_device(writeback=True):
            state = load_latest(self.run_dir.checkpoints, self.chunks, self.learner.optimizer,
                                layout=asdict(self.cfg.parallel), device=self.device, reference=self.learner.reference)
        if state is None:
            return None
        if state["seed"] != self.cfg.train.seed:
            raise ValueError(f"train.seed: {self.cfg.train.seed}, but {state['path']} was written with seed "
                             f"{state['seed']}: the resumed run would draw other prompts")
        self.learner.updates_skipped = state["updates_skipped"]
        if self.schedule.producing:
            self.pending = read_rank0_file(state["path"], PENDING_FILE)
        if self.rank == 0 and state["parallel"] != asdict(self.cfg.parallel):
            print(f"resuming {state['path']} written at {state['parallel']} (world {state['world']}) at "
                  f"{asdict(self.cfg.parallel)} (world {dist.get_world_size()}): resharded", flush=True)
        return int(state["step"])

    def _stop_requested(self) -> bool:
        """Whether the job script asked for a checkpoint and a stop (`RunDir.stop_file`); rank 0 looks and every rank
        follows it, so that all ranks stop after the same step."""
        box = [self.run_dir.stop_file.exists() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return bool(box[0])

    # -- the run --------------------------------------------------------------------------------------------------
    def run(self, *, resume: bool | str = False) -> list[dict]:
        """Train from step 0, or (resume True) from the last complete checkpoint, or (resume "auto", as a
        requeued or chained Slurm job runs) from it when there is one. Engines the trainer launched stop with it."""
        try:
            return self._run(resume)
        finally:
            try:
                if self.engine is not None:  # first: a producer still generating (a failed step) then fails fast
                    self.engine.close()
                self.schedule.close()
            finally:
                self.learner.close()

    def _run(self, resume) -> list[dict]:
        cfg = self.cfg
        check_run_dir(self.run_dir.path, resume)  # (the CLI checked too, before any process started)
        start = self.resume() if resume else None
        if start is None:
            if resume is True:  # checkpoints gone since the check
                raise FileNotFoundError(f"--resume: no complete checkpoint under {self.run_dir.checkpoints}")
            self.logger.truncate(after_step=-1)
            self.initialize()
            if cfg.objective.needs_reference:  # pi_ref: the weights RL starts from, frozen
                self.learner.keep_reference()
            start = 0
        else:
            self.logger.truncate(after_step=start)
        self.sync_weights(start)
        self.schedule.start(start, self.pending)
        if start == 0:
            self.logger.log({"step": 0, **self.rollouts.evaluate(0),
                             **{f"data/overlong_prompts_skipped/{k}": v for k, v in self.data.skipped.items() if v}})
        self.logger.start(total=cfg.train.steps, done=start)
        checkpoint_s = None  # the last save's seconds, logged on the next row (a row is logged before its save)
        for step in range(start, cfg.train.steps):
            row = self.train_step(step)
            last = step + 1 == cfg.train.steps
            if (step + 1) % cfg.train.eval_every == 0 or last:
                row.update(self.rollouts.evaluate(step + 1))
            self.finish_saves(blocking=False)
            if checkpoint_s is not None:
                row["perf/checkpoint_s"], checkpoint_s = checkpoint_s, None
            self.logger.log(row)
            saved = (step + 1) % cfg.train.checkpoint_every == 0 or last
            if saved:
                t0 = time.perf_counter()
                self.save(step + 1)
                checkpoint_s = time.perf_counter() - t0
            if not last and self._stop_requested():
                if not saved:
                    self.save(step + 1)
                self.finish_saves()  # published before the job is told to requeue
                if self.rank == 0:
                    self.run_dir.requeue_file.write_text(f"{step + 1}\n")
                    print(f"stop requested: checkpointed after step {step + 1}; the job requeues and resumes",
                          flush=True)
                break
        self.finish_saves()
        self.logger.finish()
        return self.logger.rows
