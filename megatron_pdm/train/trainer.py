"""The RL loop: rollout -> reward -> advantages -> masked policy-gradient updates on TP-sharded logits -> weight
sync -> evaluation, on megatron-core (DDP, optimizer, finalize_model_grads) over any TP / EP / DP layout.

Every rank runs `Trainer.run`. Rank 0 owns the rollout engine (the embedded engine here; any `RolloutEngine`)
and broadcasts each step's samples; data-parallel ranks then train on disjoint slices of every minibatch, and
tensor-parallel ranks on the same slice.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_pdm.compat import cuda_to_cpu_scope
from megatron_pdm.models import (
    build_model,
    causal_mask,
    forward_logits,
    hf_state_from_model,
    initialize_parallel,
    routing_replay,
)
from megatron_pdm.models.gpt import te_available
from megatron_pdm.models.hf import architecture_mismatches, load_hf_checkpoint, load_hf_into_model
from megatron_pdm.objectives import Metrics, compute_advantages, loss_normalizer, policy_loss
from megatron_pdm.precision import rollout_engine_dtype
from megatron_pdm.rollout import EmbeddedEngine, RolloutSample, SamplingParams
from megatron_pdm.rollout.launcher import LaunchSpec
from megatron_pdm.rollout.sglang import SGLangEngine
from megatron_pdm.vocab_parallel import token_logprobs

from .batch import Batch, informative_groups, overlong_penalty, plan_minibatches, rollout_batch, sequences
from .checkpoint import REQUEUE_FILE, STOP_FILE, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import Config
from .data import PromptSet, RLData, load_reward, load_rl_data, score
from .logging import RunLogger


def _step_seed(seed: int, step: int, salt: int) -> int:
    return (seed * 1_000_003 + step * 7919 + salt) % (2**62)


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, data: RLData | None = None):
        """data: the tokenizer and prompts (`load_rl_data(cfg)`, loaded here when not given)."""
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.data = data if data is not None else load_rl_data(cfg)  # every input error before a model is built
        self.tokenizer = self.data.tokenizer
        self.rank = dist.get_rank()
        initialize_parallel(cfg.parallel, seed=cfg.train.seed)
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.tp_group = ps.get_tensor_model_parallel_group() if cfg.parallel.tensor > 1 else None
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        # the device of the weights, the batches and every collective (NCCL groups take CUDA tensors only)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        cfg.check_world_size(dist.get_world_size(), f"this run's {dist.get_world_size()} ranks")  # --nproc, torchrun
        cfg.precision.check_hardware(cuda=torch.cuda.is_available(), transformer_engine=te_available())
        # variable_seq_lengths: pipeline stages exchange activation shapes, so micro-batches may differ in size
        prec = cfg.precision
        self.params_dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(prec.train, torch.bfloat16)
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
            if cfg.train.recompute == "full" else {}
        fp8 = dict(fp8="e4m3", fp8_recipe=prec.fp8_recipe) if prec.train == "fp8" else {}
        self.model = build_model(cfg.model, cfg.parallel, params_dtype=self.params_dtype, bf16=prec.bf16,
                                 fp16=prec.fp16, **recompute, **fp8, calculate_per_token_loss=True,
                                 variable_seq_lengths=cfg.parallel.pipeline > 1,
                                 **(dict(moe_enable_routing_replay=True) if cfg.rollout.routed_experts else {}))
        with cuda_to_cpu_scope():
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

            self.ddp = DistributedDataParallel(
                config=self.model.config,
                ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                         use_distributed_optimizer=cfg.optim.distributed_optimizer),
                module=self.model,
            )
        self.optimizer = self._optimizer(cfg.optim.lr)
        self.updates_skipped = 0  # optimizer steps skipped on fp16 overflow
        self.engine = self._engine() if self.rank == 0 else None
        self.reward_fn = load_reward(cfg.data.reward) if self.rank == 0 else None  # rank 0 scores, once per sample
        self.logger = RunLogger(self.run_dir, cfg, enabled=self.rank == 0)

    # -- setup ----------------------------------------------------------------------------------------------
    def _engine(self):
        r = self.cfg.rollout
        dtype, quantization = rollout_engine_dtype(self.cfg.precision.rollout)
        if r.engine == "sglang":
            if not r.urls and not r.num_engines:
                raise ValueError("rollout.urls / rollout.num_engines: the sglang engine needs worker URLs or a number "
                                 "of engines to launch (megatron-pdm submit fills in the URLs of those it starts)")
            launch = None
            if r.num_engines:  # FP8: the engines start from, and are sent, block-FP8 weights (no online quantization)
                launch = LaunchSpec(server=r.server, num_engines=r.num_engines, tp=r.engine_tp, dtype=dtype,
                                    quantization=None, kv_cache_dtype=self.cfg.precision.kv_cache,
                                    server_args=r.server_args, routed_experts=r.routed_experts,
                                    memory_saver=r.release_memory and r.server == "sglang",
                                    log_dir=self.run_dir / "logs")
            engine = SGLangEngine(r.urls, self.cfg.model, weight_dir=r.weight_dir or self.run_dir / "weights",
                                  launch=launch, router=r.router, weight_sync=r.weight_sync, timeout=r.timeout_s,
                                  retries=r.retries, max_restarts=r.max_restarts, engine_tp=r.engine_tp,
                                  quantization=quantization, dtype=dtype,
                                  tokenizer_dir=self.tokenizer.path)
            engine.wait_ready()
            return engine
        return EmbeddedEngine(self.cfg.model, dtype=dtype, quantization=quantization)

    def _optimizer(self, lr: float):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o, prec = self.cfg.optim, self.cfg.precision
        with cuda_to_cpu_scope():
            return get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                                adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
                                params_dtype=self.params_dtype, bf16=prec.bf16, fp16=prec.fp16,
                                loss_scale=None if prec.loss_scale == "dynamic" else
                                (None if prec.loss_scale == "none" else float(prec.loss_scale)),
                                initial_loss_scale=2.0**16,  # megatron's 2**32 skips the first ~16 fp16 steps
                                use_distributed_optimizer=o.distributed_optimizer),
                [self.ddp],
            )

    # -- one optimizer step over micro-batches ----------------------------------------------------------------
    def _optimizer_step(self, microbatches, loss_fn) -> tuple[float, float, Metrics]:
        """One optimizer update over micro-batches (objects with `.input_ids` [B, S]); loss_fn(mb, logits) ->
        (loss contribution, Metrics). The contributions of all micro-batches on all DP ranks sum to the step's
        loss (global normalisers), so gradients are summed, never averaged. With pipeline parallelism the
        micro-batches go through megatron's pipeline schedule and the loss runs on the last stage."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        collected = []
        with cuda_to_cpu_scope():
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        # fp16: backward runs on loss x loss scale, which the optimizer divides out (and skips a step that
        # overflowed, lowering the scale); 1 for fp32 / bf16
        loss_scale = self.optimizer.get_loss_scale().detach()
        # MoE load-balancing loss: coefficient x its mean over the step's micro-batches and DP ranks (megatron's
        # weighting without per-token losses). With calculate_per_token_loss the router multiplies a micro-batch's
        # aux loss by the tokens it routed on this rank (router.py, attach_and_log_load_balancing_loss) for a
        # division by the global token count that our globally normalised losses never make: divide it out here.
        # Megatron's pipeline schedule resets the scale to the bare loss scale after every forward (schedules.py,
        # forward_step_calc_loss), so under PP it is set again as each micro-batch's backward starts.
        seq_shards = self.cfg.parallel.tensor if self.model.config.sequence_parallel else 1  # tokens split over TP
        aux_base = loss_scale.to(self.device, torch.float32).reshape(1) / (len(microbatches) * self.dp)

        def aux_scale(mb) -> torch.Tensor:  # a device op: no host sync per micro-batch
            return aux_base / (mb.input_ids.numel() // seq_shards)  # the tokens this rank's routers see

        if self.cfg.parallel.pipeline == 1:
            for mb in microbatches:
                MoEAuxLossAutoScaler.set_loss_scale(aux_scale(mb))
                with routing_replay(self.model, getattr(mb, "routed_experts", None), tp_group=self.tp_group):
                    loss, m = loss_fn(mb, forward_logits(self.ddp, mb.input_ids))
                    (loss * loss_scale.to(loss.device, loss.dtype)).backward()
                collected.append((loss.detach(), m))
        else:
            self.model.config.grad_scale_func = self.optimizer.scale_loss
            self._pipeline_forward_backward(microbatches, loss_fn, collected, aux_scale)
        with cuda_to_cpu_scope():
            finalize_model_grads([self.ddp])
            ok, grad_norm, _ = self.optimizer.step()
        self.updates_skipped += int(not ok)
        # the step's loss: summed on the device, read once below (the one host sync of an optimizer step)
        total = torch.stack([loss.to(self.device, torch.float64) for loss, _ in collected]).sum() if collected \
            else torch.zeros((), dtype=torch.float64, device=self.device)
        metrics = Metrics()
        for _, m in collected:
            metrics.merge(m)
        if self.cfg.parallel.pipeline > 1:  # the loss lives on the last stage: share it with the whole pipeline
            box = [(float(total), metrics)]
            dist.broadcast_object_list(box, src=self.ps.get_pipeline_model_parallel_last_rank(),
                                       group=self.ps.get_pipeline_model_parallel_group())
            total = torch.tensor(box[0][0], dtype=torch.float64, device=self.device)  # on the GPU for NCCL
            metrics = box[0][1]
        if self.dp > 1:
            dist.all_reduce(total, group=self.dp_group)
        return float(total), float(grad_norm if grad_norm is not None else float("nan")), metrics

    def _pipeline_forward_backward(self, microbatches, loss_fn, collected, aux_scale):
        """megatron's pipeline schedule over the micro-batches; aux_scale(mb): the MoE load-balancing loss scale
        of micro-batch mb, set when its backward reaches this stage's output, before any router's backward."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        per = self.cfg.model.num_layers // self.cfg.parallel.pipeline
        layers = slice(self.ps.get_pipeline_model_parallel_rank() * per,
                       (self.ps.get_pipeline_model_parallel_rank() + 1) * per)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            B, S = mb.input_ids.shape
            routed = getattr(mb, "routed_experts", None)
            # routing is read in the forward pass only (no recompute with R3), so the replay may end with it
            with routing_replay(self.model, None if routed is None else routed[:, :, layers], tp_group=self.tp_group):
                device = mb.input_ids.device
                output = model(mb.input_ids, torch.arange(S, device=device)[None].expand(B, S), causal_mask(S, device))
            if self.cfg.model.is_moe and output.requires_grad:  # the schedule's own scale is wrong, see above
                output.register_hook(lambda grad, mb=mb: MoEAuxLossAutoScaler.set_loss_scale(aux_scale(mb)))

            def loss_func(output_tensor):
                loss, m = loss_fn(mb, output_tensor)
                collected.append((loss.detach(), m))
                return loss, torch.tensor(1), {}

            return output, loss_func

        with cuda_to_cpu_scope():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(microbatches), model=[self.ddp],
                num_microbatches=len(microbatches), seq_length=max(mb.input_ids.shape[1] for mb in microbatches),
                micro_batch_size=max(mb.input_ids.shape[0] for mb in microbatches), forward_only=False,
            )

    # -- warm start -------------------------------------------------------------------------------------------
    def warm_start(self):
        """A few supervised steps on (prompt, answer) pairs so that sampling finds rewards; a fresh optimizer
        is made for RL afterwards."""
        t = self.cfg.train
        self.optimizer = self._optimizer(t.warm_start_lr)
        g = torch.Generator().manual_seed(t.seed)
        train = self.data.train
        for _ in range(t.warm_start_steps):
            idx = torch.randint(0, len(train.problems), (64,), generator=g).tolist()
            answers = [self.tokenizer.encode(train.problems[i].answer, special=False) + [self.tokenizer.eos_id]
                       for i in idx]
            batch = sequences([train.prompt_ids[i] for i in idx], answers, pad_id=self.tokenizer.pad_id,
                              multiple=self.cfg.parallel.tensor)
            per = batch.rows // self.dp
            local = batch.select(self.dp_rank * per, (self.dp_rank + 1) * per).to(self.device)

            def sft_loss(mb, logits, n_global=batch.num_tokens):
                lp = token_logprobs(mb.response_logits(logits), mb.targets, group=self.tp_group)
                return -lp.sum() / n_global, Metrics()

            self._optimizer_step([local], sft_loss)
        self.optimizer = self._optimizer(self.cfg.optim.lr)

    # -- rollout ----------------------------------------------------------------------------------------------
    def _sync_weights(self, version: int):
        state = hf_state_from_model(self.model, self.cfg.model)  # collective over TP / EP
        if self.engine is not None:
            self.engine.update_weights(state, version)

    def sample_prompts(self, count: int, seed: int) -> PromptSet:
        """`count` training prompts drawn uniformly with replacement (the same on every rank for the same seed)."""
        train = self.data.train
        idx = torch.randint(0, len(train.problems), (count,), generator=torch.Generator().manual_seed(seed)).tolist()
        return PromptSet([train.problems[i] for i in idx], [train.prompt_ids[i] for i in idx])

    def rollout(self, prompts: PromptSet, n: int, seed: int, *, temperature: float | None = None,
                 top_p: float | None = None) -> tuple[list[RolloutSample], torch.Tensor]:
        """n samples per prompt from rank 0's engine and their rewards (scored on rank 0), broadcast to every rank."""
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
            _, rewards = self.rollout(prompts, t.eval_samples, _step_seed(t.seed, step, 2 + 1000 * i),
                                       temperature=t.eval_temperature, top_p=t.eval_top_p)
            per_prompt = rewards.view(-1, t.eval_samples)
            prefix = f"eval/{name}/" if name else "eval/"
            out[prefix + "reward"] = float(per_prompt.mean())
            out[prefix + f"pass@{t.eval_samples}"] = float((per_prompt.max(dim=1).values > 0).float().mean())
        if "eval/reward" not in out:
            out["eval/reward"] = sum(v for k, v in out.items() if k.endswith("/reward")) / len(self.data.evals)
        return out

    def rollout_batch(self, samples: list[RolloutSample], advantages: torch.Tensor,
                      in_loss: list[bool] | None = None) -> Batch:
        """The training batch of a rollout, on this rank's device (one host-to-device copy per tensor). Responses
        cut at max_new_tokens leave the loss with rollout.overlong mask, as do samples with in_loss False."""
        m = self.cfg.model
        cut = self.cfg.rollout.overlong == "mask"
        in_loss = [(in_loss is None or in_loss[i]) and not (cut and s.finish_reason == "length")
                   for i, s in enumerate(samples)]
        return rollout_batch(samples, advantages, pad_id=self.tokenizer.pad_id, multiple=self.cfg.parallel.tensor,
                             vocab_size=m.vocab_size, routed_experts=(m.num_layers, m.moe_router_topk)
                             if self.cfg.rollout.routed_experts else None, in_loss=in_loss).to(self.device)

    @torch.no_grad()
    def _step_start_logprobs(self, batch: Batch, sizes: list[int]) -> torch.Tensor:
        """log pi_old(k) of every response token of `batch` under the weights before this step's first update."""
        out = []
        for mb in batch.split(sizes):  # the training step's micro-batches: the same count on every rank
            with routing_replay(self.model, mb.routed_experts, tp_group=self.tp_group):
                z = mb.response_logits(forward_logits(self.ddp, mb.input_ids))
            out.append(token_logprobs(z, mb.targets, group=self.tp_group, temperature=self.cfg.objective.temperature))
        return torch.cat(out)

    def _rl_loss(self, mb: Batch, logits, normalizer):
        out = policy_loss(mb.response_logits(logits), mb.behavior, mb.advantages, mb.loss_mask, self.cfg.objective,
                          normalizer=normalizer, sequence_ids=mb.sequence_ids, old_logprobs=mb.old_logprobs,
                          tp_group=self.tp_group)
        return out.loss, out.metrics

    def collect(self, step: int) -> tuple[list[RolloutSample], torch.Tensor, int, dict]:
        """The step's groups and their rewards: prompts_per_step prompts x rollout.n samples, rewards shaped by the
        overlong penalty; with train.filter_groups, only groups whose rewards differ (the others add no gradient),
        refilled by further rollouts (train.refill) up to train.max_rollout_rounds, then topped up with dropped
        groups (placed last). Also how many samples are informative (the rest: top-up, kept out of the loss and
        its normaliser) and (rollout/*) rounds, dropped groups and the mean reward of everything sampled."""
        t, r = self.cfg.train, self.cfg.rollout
        kept, dropped, sampled, rounds = [], [], [], 0
        while True:
            prompts = self.sample_prompts(t.prompts_per_step, _step_seed(t.seed, step, 1 + 10 * rounds))
            samples, rewards = self.rollout(prompts, r.n, _step_seed(t.seed, step, 10 * rounds))
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

    def train_step(self, step: int) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        samples, rewards, informative, stats = self.collect(step)
        t_rollout = time.perf_counter() - t0
        out = {"step": step + 1, **stats, "train/updates_skipped": self.updates_skipped,
               "perf/rollout_s": t_rollout}
        if len(samples) < self.dp:  # every group was dropped: nothing to learn, the engines keep their memory
            return {**out, "train/no_informative_group": 1, "perf/tokens_per_s": 0.0,
                    "perf/step_s": time.perf_counter() - t0}
        if cfg.rollout.release_memory and self.engine is not None:  # colocated: the trainer takes the GPUs
            self.engine.release_memory()
        advantages = compute_advantages(cfg.objective.advantage, rewards, cfg.rollout.n,
                                        eps=cfg.objective.advantage_std_eps)
        plans = plan_minibatches([len(s.prompt_ids) + len(s.response_ids) for s in samples],
                                 minibatches=cfg.train.minibatches, ranks=self.dp,
                                 micro_batch_size=cfg.train.micro_batch_size,
                                 max_tokens=cfg.train.max_tokens_per_microbatch)
        locals_ = []  # this rank's share of each minibatch, and its micro-batch sizes
        for per_rank in plans:
            rows, sizes = per_rank[self.dp_rank]
            locals_.append((self.rollout_batch([samples[i] for i in rows], advantages[rows],
                                               [i < informative for i in rows]), sizes))
        if cfg.objective.correction != "none":  # pi_old: every minibatch's tokens, before the first update
            for local, sizes in locals_:
                local.old_logprobs = self._step_start_logprobs(local, sizes)
        losses, norms, metrics, computed = [], [], Metrics(), torch.zeros(2, dtype=torch.float64)
        t_train = time.perf_counter()
        for m, (local, sizes) in enumerate(locals_):
            normalizer = loss_normalizer(local.loss_mask, local.sequence_ids, cfg.objective.aggregation,
                                         group=self.dp_group)
            mbs = local.split(sizes)
            computed += torch.tensor([sum(mb.rows * mb.width for mb in mbs), local.real_tokens], dtype=torch.float64)
            loss, gnorm, m_metrics = self._optimizer_step(
                mbs, lambda mb, logits, n=normalizer: self._rl_loss(mb, logits, n))
            losses.append(loss)
            norms.append(gnorm)
            metrics.merge(m_metrics)
            if m == 0:  # before any update of this step pi is the policy mu sampled from, up to precision
                metrics.merge(m_metrics.renamed("mismatch/", "mismatch_start/"))
        t_train = time.perf_counter() - t_train
        if self.dp > 1:  # positions computed and real tokens over the DP ranks: once per step
            computed = computed.to(self.device)
            dist.all_reduce(computed, group=self.dp_group)
        positions, real = computed.tolist()
        self._sync_weights(step + 1)
        elapsed = time.perf_counter() - t0
        tokens = int(sum(len(s.response_ids) for s in samples))
        out.update({
            "train/loss": sum(losses) / len(losses),
            "train/grad_norm": sum(norms) / len(norms),
            "train/response_length": tokens / len(samples),
            "train/loss_scale": float(self.optimizer.get_loss_scale()),
            "train/updates_skipped": self.updates_skipped,
            "perf/tokens_per_s": tokens / elapsed,
            "perf/train_tokens_per_s": real / t_train,
            "perf/padding_frac": 1 - real / positions,
            "perf/step_s": elapsed,
        })
        out.update(metrics.reduce(self.dp_group))
        return out

    # -- the run ---------------------------------------------------------------------------------------------
    def initialize(self) -> None:
        """train.init (random, or an HF checkpoint), then the supervised warm start if asked."""
        cfg = self.cfg
        if cfg.train.init == "hf":
            state, hf_cfg = load_hf_checkpoint(cfg.train.init_path)
            diffs = architecture_mismatches(cfg.model, hf_cfg)
            if diffs:
                raise ValueError(f"train.init_path: the checkpoint differs from the model section: {'; '.join(diffs)}")
            load_hf_into_model(self.model, state, cfg.model)
        if cfg.train.warm_start_steps:
            self.warm_start()

    def _stop_requested(self) -> bool:
        """Whether the job script asked for a checkpoint and a stop (STOP_FILE); rank 0 looks and every rank
        follows it, so that all ranks stop after the same step."""
        box = [(self.run_dir / STOP_FILE).exists() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return bool(box[0])

    def run(self, *, resume: bool | str = False) -> list[dict]:
        """Train from step 0, or (resume True) from the last complete checkpoint, or (resume "auto", as a
        requeued or chained Slurm job runs) from it when there is one. Engines the trainer launched stop with it."""
        try:
            return self._run(resume)
        finally:
            if self.engine is not None:
                self.engine.close()

    def _run(self, resume) -> list[dict]:
        cfg, start = self.cfg, 0
        ckpt = latest_checkpoint(self.run_dir / "checkpoints") if resume else None
        if ckpt is not None:
            start = load_checkpoint(ckpt, self.model, self.optimizer, rank=self.rank)
            self.logger.truncate(after_step=start)
        elif resume is True:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {self.run_dir / 'checkpoints'}")
        else:
            if latest_checkpoint(self.run_dir / "checkpoints") is not None:
                raise FileExistsError(f"{self.run_dir}: holds checkpoints of an earlier run; pass --resume to "
                                      "continue it or choose another --run-dir")
            self.logger.truncate(after_step=-1)
            self.initialize()
        self._sync_weights(start)
        if start == 0:
            self.logger.log({"step": 0, **self.evaluate(0),
                             **{f"data/overlong_prompts_skipped/{k}": v for k, v in self.data.skipped.items() if v}})
        self.logger.start(total=cfg.train.steps, done=start)
        for step in range(start, cfg.train.steps):
            row = self.train_step(step)
            last = step + 1 == cfg.train.steps
            if (step + 1) % cfg.train.eval_every == 0 or last:
                row.update(self.evaluate(step + 1))
            self.logger.log(row)
            saved = (step + 1) % cfg.train.checkpoint_every == 0 or last
            if saved:
                save_checkpoint(self.run_dir / "checkpoints", step + 1, self.model, self.optimizer, rank=self.rank,
                                keep_last=cfg.train.keep_last)
            if not last and self._stop_requested():
                if not saved:
                    save_checkpoint(self.run_dir / "checkpoints", step + 1, self.model, self.optimizer,
                                    rank=self.rank, keep_last=cfg.train.keep_last)
                if self.rank == 0:
                    (self.run_dir / REQUEUE_FILE).write_text(f"{step + 1}\n")
                    print(f"stop requested: checkpointed after step {step + 1}; the job requeues and resumes",
                          flush=True)
                break
        self.logger.finish()
        return self.logger.rows
