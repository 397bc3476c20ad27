"""The step: the trained policy (megatron-core GPTModel, DDP, megatron optimizer), its one forward/backward path,
the RL loss and the optimizer update.

Every forward and backward pass, at every pipeline size, goes through megatron's `get_forward_backward_func`
(PP = 1: its no-pipelining schedule; with virtual stages, its interleaved one): the RL update, the supervised warm
start and the step-start recompute of log pi_old. So the loss runs on the last stage, the MoE load-balancing loss
scale has one home (`_aux_scale`), and everything that works at PP = 1 works under PP.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist

from megatron_pdm.compat import cuda_to_cpu_scope, lowp_gemm_scope
from megatron_pdm.models import (
    ParallelContext,
    build_model_chunks,
    causal_mask,
    end_routing_replay,
    fuse_output_layer,
    output_weight,
    routing_replay,
)
from megatron_pdm.objectives import (
    Metrics,
    distill_advantages,
    distill_token_divergence,
    distill_weights,
    policy_loss,
    policy_loss_from_hidden,
)
from megatron_pdm.precision import megatron_model_settings, megatron_optimizer_settings
from megatron_pdm.vocab_parallel import (
    BehaviorTopK,
    fused_output_loss,
    output_logprobs,
    support_logprobs,
    token_logprobs,
)

from .aux_loss import AuxLossCount, probe_aux_loss_count
from .batch import Batch
from .config import Config
from .weight_sync import WeightSync


class HostWeights:
    """The parameters of `modules` kept in host memory (pinned when `device` is CUDA) and put on `device` only
    inside `on_device()`: for weights used a few times a step (the reference policy, `objective.ref_offload`), whose
    device memory is then free the rest of the step. Each entry is a host tensor, swapped in as `param.data`;
    `on_device` costs one host-to-device copy of them (non-blocking from pinned memory), and with writeback (a
    checkpoint loaded into them) one copy back. Buffers (rotary tables) and the parameters in `keep` stay where they
    are."""

    def __init__(self, modules, device: torch.device, *, keep=()):
        self.device = device
        self.params = [p for m in modules for p in m.parameters() if not any(p is k for k in keep)]
        pin = device.type == "cuda"
        self.host = [p.detach().to("cpu", copy=True).pin_memory() if pin else p.detach().to("cpu", copy=True)
                     for p in self.params]
        for p, h in zip(self.params, self.host, strict=True):
            p.data = h

    @contextlib.contextmanager
    def on_device(self, *, writeback: bool = False):
        for p, h in zip(self.params, self.host, strict=True):
            p.data = h.to(self.device, non_blocking=True, copy=True)  # a copy on a CPU too: writeback means it
        try:
            yield
        finally:
            for p, h in zip(self.params, self.host, strict=True):
                if writeback:
                    h.copy_(p.data)
                p.data = h


class Learner:
    """The model being trained, on this rank's device, with its process groups (`parallel`, the context built at
    start-up): `chunks`, its model chunks (one per virtual pipeline stage, one without), each wrapped in megatron's
    DDP (`ddp`), and one optimizer over them. Context parallelism: the CP ranks of a DP rank share its sequences,
    each computing the tokens of its own chunks, so losses and metrics sum over DP x CP (`parallel.dp_cp_group`;
    megatron's DDP sums gradients over that group too)."""

    def __init__(self, cfg: Config, device: torch.device, parallel: ParallelContext):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.cfg, self.device, self.parallel = cfg, device, parallel
        if cfg.optim.cpu_offload and device.type != "cuda":
            raise ValueError(f"optim.cpu_offload: {cfg.optim.cpu_offload} moves optimizer state from GPU to host "
                             "memory; this run trains on the CPU, where it already is (set it to 0)")
        self.temperature = cfg.rollout.temperature  # log pi = log_softmax(logits / T), as the engine samples
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
            if cfg.train.recompute == "full" else {}
        # variable_seq_lengths: pipeline stages exchange activation shapes, so micro-batches may differ in size
        self.model_settings = dict(**megatron_model_settings(cfg.precision), calculate_per_token_loss=True,
                                   variable_seq_lengths=parallel.pp > 1)
        self.chunks = build_model_chunks(
            cfg.model, parallel, **self.model_settings, **recompute,
            **(dict(moe_enable_routing_replay=True) if cfg.rollout.routed_experts else {}))
        # train.fused_output_layer: the last chunk returns hidden states, the losses multiply by the output weight
        # chunk by chunk (no [tokens, V/tp] logits); every loss_fn below gets what the last chunk returns
        self.fused = cfg.train.fused_output_layer
        if self.fused:
            fuse_output_layer(self.chunks[-1])
        self.weight_sync = WeightSync()  # a later stage's sender's weights group with the engines lives here
        self.config = self.chunks[0].config  # the chunks' one TransformerConfig
        self.chunk_layers = parallel.chunk_layers(cfg.model.num_layers)  # global decoder layers of each chunk
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=cfg.optim.distributed_optimizer)
        with cuda_to_cpu_scope():  # one gradient bucket for each later chunk, as megatron-LM builds them
            self.ddp = [DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=c,
                                                disable_bucketing=i > 0) for i, c in enumerate(self.chunks)]
        self.optimizer = self.new_optimizer(cfg.optim.lr)
        self.reference = None  # the frozen reference policy's chunks (objective.kl_coef): `keep_reference`
        self.reference_host = None  # its weights in host memory (objective.ref_offload): `HostWeights`
        self.teacher = None  # the in-trainer teacher's chunks (distill.teacher): `keep_teacher`
        self.teacher_host = None  # its weights in host memory (distill.teacher_offload)
        self.teacher_s = 0.0  # seconds of teacher forward passes this step (distill/teacher_s)
        self.updates_skipped = 0  # optimizer steps skipped: fp16 overflow, or a non-finite gradient (`_grads_finite`)
        self.aux_count = self._aux_loss_count()  # how megatron's routers count a micro-batch's tokens (`_aux_scale`)

    def keep_reference(self) -> None:
        """pi_ref := the current weights, frozen (objective.kl_coef): a second set of model chunks of this layout in
        the training dtype, without gradients, gradient buffers or optimizer state (cost: one more copy of this rank's
        weights; `plan` counts it). Building them draws no random number the run would otherwise see."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        if self.reference is None:
            tracker = get_cuda_rng_tracker()
            states = tracker.get_states()
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                self.reference = build_model_chunks(self.cfg.model, self.parallel, **self.model_settings,
                                                    perform_initialization=False)  # the weights are copied in
            tracker.set_states(states)
            if self.fused:
                fuse_output_layer(self.reference[-1])
        for ref, chunk in zip(self.reference, self.chunks, strict=True):
            ref.load_state_dict(chunk.state_dict())  # into host memory too, once offloaded
            ref.requires_grad_(False)
        if self.cfg.objective.ref_offload and self.reference_host is None:
            # the exact KL multiplies by the reference's output weight in every micro-batch: it stays
            keep = [self.reference_output_weight()] if self.exact_kl else []
            self.reference_host = HostWeights(self.reference, self.device, keep=keep)

    def keep_teacher(self) -> None:
        """The in-trainer teacher (distill.teacher): model chunks of the teacher's own config (layers, widths) at this
        run's TP, loaded from its HF checkpoint, frozen (no gradients, buffers or optimizer state; `plan` counts one
        copy of its weights per rank), offloaded to host memory with distill.teacher_offload except its output
        weight, which every micro-batch multiplies by. Reloaded from its source on resume (never checkpointed).
        Building it draws no random number the run would otherwise see."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        from megatron_pdm.models import load_hf_checkpoint, load_hf_into_model

        if self.teacher is not None:
            return
        d = self.cfg.distill
        tcfg = d.teacher_model(self.cfg.model)
        state, _ = load_hf_checkpoint(d.teacher)
        tracker = get_cuda_rng_tracker()
        states = tracker.get_states()
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self.teacher = build_model_chunks(tcfg, self.parallel, **self.model_settings, perform_initialization=False)
        tracker.set_states(states)
        load_hf_into_model(self.teacher, state, tcfg, self.parallel)
        if self.fused:
            fuse_output_layer(self.teacher[-1])
        for chunk in self.teacher:
            chunk.requires_grad_(False)
        if d.teacher_offload:
            self.teacher_host = HostWeights(self.teacher, self.device, keep=[output_weight(self.teacher[-1])])

    @torch.no_grad()
    def teacher_pass(self, microbatches: list[Batch]) -> None:
        """Set `teacher_hidden` on each micro-batch: the teacher's last hidden states at the response positions
        [N, H_t] (what its output layer reads), from which `rl_loss` recomputes its logits shard per micro-batch (never
        gathered; H_t values a token kept over the minibatch, one more GEMM per micro-batch). With distill.as_reward
        the advantages take reward_coef (log t(y) - log mu(y)) per token here, before the update."""
        import time

        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        t0, hidden, last = time.perf_counter(), [], self.teacher[-1]
        hook = None if self.fused else last.output_layer.register_forward_pre_hook(
            lambda _m, args: hidden.append(args[0]))

        def run(mb, out):
            if self.fused:
                return torch.zeros((), device=out.device), mb.response_logits(out)
            h = hidden.pop()  # [S (/ TP under sequence parallelism), B, H_t]
            if last.config.sequence_parallel:
                h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False,
                                                         group=self.parallel.tp_group)
            return torch.zeros((), device=out.device), mb.response_logits(h.transpose(0, 1))

        try:
            with self.teacher_host.on_device() if self.teacher_host is not None else contextlib.nullcontext():
                results = self.forward_backward(microbatches, run, forward_only=True, models=self.teacher)
        finally:
            if hook is not None:
                hook.remove()
        objective = self.cfg.distill.objective
        for mb, h in zip(microbatches if results else [], results, strict=True):
            mb.teacher_hidden = h
            if objective.as_reward:
                t_lp = token_logprobs(self.teacher_logits(h), mb.targets, group=self.parallel.tp_group,
                                      temperature=self.temperature)
                mb.advantages = distill_advantages(objective, mb.advantages, t_lp, mb.behavior.token_logprobs)
        self.teacher_s += time.perf_counter() - t0

    def teacher_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The teacher's logits shard [N, V/tp] from its hidden states: one [N, H_t] x [H_t, V/tp] GEMM."""
        return hidden @ output_weight(self.teacher[-1]).t()

    def distill_term(self, mb: Batch, out, normalizer):
        """(coef x the aggregated D(pi, t), metrics) of micro-batch mb against the teacher's logits shard. Without the
        fused output layer, autograd through the student's logits shard; with it, chunk by chunk like the policy
        loss (`vocab_parallel.fused_output_loss`): each chunk's logits h W^T and dD/dz by the divergence's own
        backward, then grad_h = dz W and grad_W += dz^T h (one more GEMM forward and two backward per chunk, no
        [N, V/tp] kept), handed to autograd as precomputed gradients (they go to the weight's main_grad as the policy
        loss's do: an ordinary autograd gradient of the weight would be dropped by megatron's DDP hook there)."""
        from megatron_pdm.vocab_parallel.fused import precomputed_gradients

        objective, group = self.cfg.distill.objective, self.parallel.tp_group
        z = mb.response_logits(out)
        weights = distill_weights(objective, mb.loss_mask, aggregation=self.cfg.objective.aggregation,
                                  normalizer=normalizer, sequence_ids=mb.sequence_ids,
                                  sequence_lengths=mb.sequence_lengths)

        def divergence(logits, hidden):
            return distill_token_divergence(objective, logits, teacher_logits=self.teacher_logits(hidden),
                                            temperature=self.temperature, tp_group=group)

        if not self.fused:
            d = divergence(z, mb.teacher_hidden)
            loss = (weights.to(d.dtype) * d).sum()
        else:
            weight = output_weight(self.chunks[-1])
            rows = max(1, 2**24 // (4 * max(1, weight.shape[0])))  # a 16 MiB float32 [rows, V/tp] logits chunk
            h = z.detach()
            grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
            parts = []
            for r in range(0, h.shape[0], rows):
                hc = h[r:r + rows]
                with torch.enable_grad():
                    zc = (hc @ weight.detach().t()).requires_grad_(True)
                    dc = divergence(zc, mb.teacher_hidden[r:r + rows])
                    (dz,) = torch.autograd.grad((weights[r:r + rows].to(dc.dtype) * dc).sum(), zc)
                grad_h[r:r + rows] = (dz.float() @ weight.float())
                grad_w.addmm_(dz.float().t(), hc.float())
                parts.append(dc.detach())
            d = torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32)
            loss = precomputed_gradients(z, weight, (weights.to(d.dtype) * d).sum(), grad_h, grad_w)
        metrics = Metrics()
        metrics.add_mean("distill/kl", d.detach(), mb.loss_mask > 0)
        with torch.no_grad():
            t_lp = token_logprobs(self.teacher_logits(mb.teacher_hidden), mb.targets, group=group,
                                  temperature=self.temperature)
        metrics.add_mean("distill/teacher_logprob", t_lp, mb.loss_mask > 0)
        return loss, metrics

    @property
    def exact_kl(self) -> bool:
        """Whether the KL penalty is the exact KL(pi || pi_ref) from the reference's logits shard."""
        return bool(self.cfg.objective.kl_coef) and self.cfg.objective.kl_type == "exact"

    def reference_output_weight(self) -> torch.Tensor | None:
        """The reference's output-layer weight shard [V/tp, H] on the last stage (the embedding's when they are
        tied), None elsewhere."""
        return output_weight(self.reference[-1])

    def reference_on_device(self, *, writeback: bool = False):
        """A context in which the reference policy's weights are on the device (a no-op unless offloaded);
        writeback: what was loaded into them is kept (a checkpoint load)."""
        if self.reference_host is None:
            return contextlib.nullcontext()
        return self.reference_host.on_device(writeback=writeback)

    def _aux_loss_count(self) -> AuxLossCount:
        """The form of the token count by which this megatron-core's routers multiply the load-balancing loss
        (it differs between releases), measured once by a small router on the TP x CP group (`aux_loss`), so that
        `_aux_scale` divides by what this megatron multiplies. Without a load-balancing loss nothing is measured
        (the scale then multiplies no loss)."""
        kind = self.config.moe_router_load_balancing_type if self.cfg.model.is_moe else "none"
        if kind == "none" or not self.cfg.model.moe_aux_loss_coeff:
            return AuxLossCount()
        return probe_aux_loss_count(kind, self.parallel.groups, self.device)

    def new_optimizer(self, lr: float):
        """A fresh megatron optimizer (Adam) over the DDP buffers, at learning rate lr."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.cfg.optim
        # CPU Adam: megatron's hybrid-device optimizer keeps this share of the fp32 main weights and Adam states
        # in host memory (the update runs there; weights cross PCIe twice per step)
        offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=o.cpu_offload) if o.cpu_offload else {}
        with cuda_to_cpu_scope():
            return get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                                adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
                                use_distributed_optimizer=o.distributed_optimizer, **offload,
                                **megatron_optimizer_settings(self.cfg.precision)),
                self.ddp,
            )

    def sync_weights(self, engine, version: int) -> None:
        """`engine` (the rollout engine on global rank 0, None elsewhere) takes these weights as `version`, in its
        format (`weight_sync.WeightSync`, kept across syncs: collective over the world; each stage's buckets written
        to the engine's export directory, or broadcast over the stage's own group, or sent through rank 0)."""
        self.weight_sync(self.chunks, self.cfg.model, engine, version, self.parallel,
                         bucket_bytes=self.cfg.rollout.sync_bucket_bytes, rollout=self.cfg.precision.rollout)

    def close(self) -> None:
        """End what outlives a step: this rank's weights group with the engines (a later stage's sender)."""
        self.weight_sync.close()

    # -- the one forward/backward path ----------------------------------------------------------------------------
    def _aux_scale(self, mb, n_microbatches: int) -> torch.Tensor:
        """The MoE load-balancing loss scale of micro-batch mb: loss scale / (M micro-batches x DP) / n. With
        calculate_per_token_loss the router multiplies a micro-batch's aux loss by n tokens (router.py,
        attach_and_log_load_balancing_loss) for a division by the global token count that our globally normalised
        losses never make: it is divided out here, so that the coefficient x aux loss enters as its mean over the
        step's micro-batches and DP ranks (the TP x CP ranks of a sequence each add their tokens' part of one
        loss, computed by megatron over that group). n, in the form this megatron uses (`aux_count`, measured):
        without a padding mask, the tokens this rank's routers see (B x S / TP under sequence parallelism); with
        one (`Batch.with_padding_mask`), the real ones among them, or those of the micro-batch's whole rows where
        megatron counts the TP x CP group's; then times the TP x CP size and / B where this megatron does so.
        Device ops only: no host sync per micro-batch. (megatron's z-loss, never enabled here, counts otherwise.)"""
        mask = getattr(mb, "padding_mask", None)  # [B, S] this CP rank's columns
        if mask is None:
            seq_shards = self.parallel.tp if self.config.sequence_parallel else 1
            n = mb.input_ids.numel() // seq_shards
        elif self.aux_count.group_tokens:
            n = sum(mb.lengths)  # whole rows, also for a context shard (host ints)
        else:
            real = self.parallel.routed_columns(~mask)
            n = real.sum().clamp_min(1)  # a chunk of padding only: its aux loss is 0 x any finite scale
        n = self.aux_count.factor(n, self.parallel.tp * self.parallel.cp, mb.input_ids.shape[0])
        loss_scale = self.optimizer.get_loss_scale().detach().to(self.device, torch.float32).reshape(1)
        return loss_scale / (n_microbatches * self.parallel.dp) / n

    def _padding_kwargs(self, mb, embeds: bool) -> dict:
        """padding_mask for megatron's MoE routers (micro-batches cut by `micro_batches`): the model chunk holding
        the embedding (`embeds`: chunk 0 of the first stage) cuts it over TP for sequence parallelism itself (GPTModel
        does so under pre_process only); every other chunk gets this TP rank's part."""
        mask = getattr(mb, "padding_mask", None)
        if mask is None:
            return {}
        return {"padding_mask": mask if embeds else self.parallel.routed_columns(mask)}

    def forward_backward(self, microbatches: list, loss_fn, *, forward_only: bool = False, models=None) -> list:
        """megatron's schedule for this pipeline size over the micro-batches (objects with `.input_ids` [B, S]; with
        virtual stages at least PP of them, as `micro_batches` cuts them). loss_fn(mb, out) -> (loss contribution,
        result) runs on the last stage, out what its last chunk returns (the logits shard, or with
        train.fused_output_layer the hidden states the output layer would multiply), whose results are returned in
        order (empty elsewhere).
        Backward runs on loss x loss scale (fp16; 1 otherwise). models: other chunks of this layout to run instead
        of the trained ones (the reference policy, forward only: it routes its own experts, no replay)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        trained = models is None
        models = self.ddp if trained else models
        # a batch's routed experts hold this rank's MoE layers (`Batch.with_routed_layers`): each chunk's positions
        moe = self.parallel.moe_layers(self.cfg.model)
        routed_at = {id(d): [moe.index(i) for i in r if i in moe] for d, r in zip(models, self.chunk_layers,
                                                                                strict=True)}
        embeds = {id(d): c.pre_process for d, c in zip(models, self.chunks, strict=True)}
        config = self.config if trained else models[0].config
        results = []

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            B, S = mb.input_ids.shape
            routed = getattr(mb, "routed_experts", None) if trained else None
            if routed is not None and routed.shape[2] != len(moe):
                raise ValueError(f"routed_experts: {routed.shape[2]} layers; this rank replays its {len(moe)} MoE "
                                 "layers (Batch.with_routed_layers)")
            # the chunk's MoE layers are replayed, in the forward pass and, under activation recompute, in the
            # backward pass's recomputed forward
            with routing_replay(model, None if routed is None else routed[:, :, routed_at[id(model)]],
                                tp_group=self.parallel.tp_group):
                device = mb.input_ids.device
                output = model(mb.input_ids, torch.arange(S, device=device)[None].expand(B, S), causal_mask(S, device),
                               **self._padding_kwargs(mb, embeds[id(model)]))
            if self.cfg.model.is_moe and output.requires_grad:
                # megatron's schedule resets the aux-loss scale to the bare loss scale after each forward
                # (schedules.py, forward_step_calc_loss): set ours as this micro-batch's backward starts
                output.register_hook(lambda grad, mb=mb: MoEAuxLossAutoScaler.set_loss_scale(
                    self._aux_scale(mb, len(microbatches))))

            def loss_func(output_tensor):
                loss, result = loss_fn(mb, output_tensor)
                results.append(result)
                return loss, torch.tensor(1), {}

            return output, loss_func

        config.grad_scale_func = self.optimizer.scale_loss
        # interleaved: every chunk reads every micro-batch, in groups of this many per chunk
        config.microbatch_group_size_per_vp_stage = interleave_group(len(microbatches), self.parallel.pp)
        data = iter(microbatches) if len(models) == 1 else [iter(microbatches) for _ in models]
        with cuda_to_cpu_scope(), lowp_gemm_scope(config.params_dtype), torch.set_grad_enabled(not forward_only):
            try:
                get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=data, model=models,
                    num_microbatches=len(microbatches),
                    seq_length=max(mb.input_ids.shape[1] for mb in microbatches) * self.parallel.cp,  # megatron / CP
                    micro_batch_size=max(mb.input_ids.shape[0] for mb in microbatches), forward_only=forward_only,
                )
            finally:  # no replayed routing outlives the schedule (queued for recompute, or left by a raise)
                for model in models:
                    end_routing_replay(model)
        return results

    def update(self, microbatches: list, loss_fn) -> tuple[float, float, Metrics]:
        """One optimizer update over micro-batches; loss_fn(mb, out) -> (loss contribution, Metrics). The
        contributions of all micro-batches on all DP x CP ranks sum to the step's loss (global normalisers), so
        gradients are summed, never averaged. Returns (loss, grad norm, metrics), the same on every rank."""
        from megatron.core.distributed import finalize_model_grads

        with cuda_to_cpu_scope():
            for d in self.ddp:
                d.zero_grad_buffer()
            self.optimizer.zero_grad()
        collected = self.forward_backward(
            microbatches, lambda mb, out: (lambda loss, m: (loss, (loss.detach(), m)))(*loss_fn(mb, out)))
        with cuda_to_cpu_scope():
            finalize_model_grads(self.ddp)
            if self.cfg.precision.fp16 or self._grads_finite():
                ok, grad_norm, _ = self.optimizer.step()
            else:  # the weights (and Adam's moments) stay as they were
                ok, grad_norm = False, float("nan")
                if dist.get_rank() == 0:
                    print("update skipped: a gradient is nan or inf (train/updates_skipped counts it); the weights "
                          "are unchanged", file=sys.stderr, flush=True)
        self.updates_skipped += int(not ok)
        # the step's loss: summed on the device, read once below (the one host sync of an optimizer step)
        total = torch.stack([loss.to(self.device, torch.float64) for loss, _ in collected]).sum() if collected \
            else torch.zeros((), dtype=torch.float64, device=self.device)
        metrics = Metrics()
        for _, m in collected:
            metrics.merge(m)
        if self.parallel.pp > 1:  # the loss lives on the last stage: share it with the whole pipeline
            # pickled on the host: a pickled CUDA tensor would come back on the sender's GPU index
            box = [(float(total), metrics.to("cpu"))]
            dist.broadcast_object_list(box, src=self.parallel.pipeline_ranks[-1], group=self.parallel.pp_group)
            total = torch.tensor(box[0][0], dtype=torch.float64, device=self.device)  # on the GPU for NCCL
            metrics = box[0][1].to(self.device)
        if self.parallel.dp * self.parallel.cp > 1:
            dist.all_reduce(total, group=self.parallel.dp_cp_group)
        return float(total), float(grad_norm if grad_norm is not None else float("nan")), metrics

    def _grads_finite(self) -> bool:
        """Whether every gradient of this update is finite, on every rank (the same answer everywhere). fp16's grad
        scaler makes this check itself and backs its scale off; under fp32 and bf16 megatron's optimizer makes none:
        a nan gradient passes clipping (max_norm / nan compares False with 1) and Adam writes nan into every weight,
        which the next weight sync hands the engines. Reads the reduced gradient buffers after
        `finalize_model_grads` (amax and amin propagate nan and show +-inf, without a temporary of the buffer's size)
        and all-reduces one flag over the world: a host sync per update."""
        ends = [f(b.grad_data).float().to(self.device) for d in self.ddp
                for b in d.buffers + d.expert_parallel_buffers if b.grad_data.numel() for f in (torch.amax, torch.amin)]
        bad = torch.zeros(1, device=self.device)
        if ends:
            bad += (~torch.isfinite(torch.stack(ends))).any()
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bad.item()

    # -- the losses -------------------------------------------------------------------------------------------------
    def micro_batches(self, batch: Batch, sizes: list[int]) -> list[Batch]:
        """This rank's micro-batches of `batch` (on the device): consecutive runs of sizes[i] rows (with virtual
        pipeline stages, at least PP runs: `at_least`), cut to this context-parallel rank's part with CP > 1
        (`Batch.context_shard`)."""
        if len(self.chunks) > 1:  # every DP rank must cut the same count: decided on the fewest rows of any
            fewest = torch.tensor([batch.rows], device=self.device)
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=self.parallel.dp_group)  # a host sync per minibatch
            sizes = at_least(sizes, self.parallel.pp, fewest=int(fewest.item()))
        mbs = batch.split(sizes)
        if self.cfg.model.is_moe:
            mbs = [mb.with_padding_mask() for mb in mbs]
        cp = self.parallel.cp
        return mbs if cp == 1 else [mb.context_shard(self.parallel.cp_rank, cp) for mb in mbs]

    @torch.no_grad()
    def step_start_logprobs(self, microbatches: list[Batch]) -> None:
        """Set `old_logprobs` (log pi_old(k) of every response token) and, for a proximal anchor,
        `anchor_logprobs` (log pi_old at the behavior's top-K ids) on each micro-batch, under the weights before
        this step's first update (the same micro-batch count on every rank); only the last pipeline stage, which
        computes the loss, gets them."""
        proximal, group = self.cfg.objective.anchor == "proximal", self.parallel.tp_group

        def old(mb, out):
            z = mb.response_logits(out)  # [N, V/tp] logits, or [N, H] hidden states (fused)
            top_ids = mb.behavior.topk_ids if proximal else None
            if self.fused:
                lp, top = output_logprobs(z, output_weight(self.chunks[-1]), mb.targets, support_ids=top_ids,
                                          group=group, temperature=self.temperature)
            else:
                lp = token_logprobs(z, mb.targets, group=group, temperature=self.temperature)
                top = support_logprobs(z, top_ids, group=group, temperature=self.temperature) if proximal else None
            return torch.zeros((), device=out.device), (lp, top)

        results = self.forward_backward(microbatches, old, forward_only=True)  # empty off the last stage
        for mb, (lp, top) in zip(microbatches if results else [], results, strict=True):
            mb.old_logprobs, mb.anchor_logprobs = lp, top

    @torch.no_grad()
    def reference_logprobs(self, microbatches: list[Batch]) -> None:
        """Set `ref_logprobs` (log pi_ref(k) of every response token, at the rollout temperature) on each micro-batch
        from the frozen reference chunks (forward only; only the last pipeline stage gets them). For the exact KL,
        `ref_hidden` instead: the reference's last hidden states at the response positions [N, H] (what its output
        layer reads), from which `rl_loss` recomputes its logits shard: H values a token kept over the minibatch,
        not V / TP, for one more GEMM per micro-batch."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        exact, hidden = self.exact_kl, []
        last = self.reference[-1]
        hook = last.output_layer.register_forward_pre_hook(lambda _m, args: hidden.append(args[0])) \
            if exact and last.post_process and not self.fused else None

        def ref(mb, logits):
            if self.fused:  # the reference's hidden states [B, S, H] (gathered over TP under sequence parallelism)
                h = mb.response_logits(logits)
                lp = h if exact else output_logprobs(h, self.reference_output_weight(), mb.targets,
                                                     group=self.parallel.tp_group, temperature=self.temperature)[0]
                return torch.zeros((), device=logits.device), lp
            if exact:  # [S (/ TP under sequence parallelism), B, H], in the forward that just ran
                h = hidden.pop()
                if last.config.sequence_parallel:
                    h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False,
                                                             group=self.parallel.tp_group)
                return torch.zeros((), device=logits.device), mb.response_logits(h.transpose(0, 1))
            lp = token_logprobs(mb.response_logits(logits), mb.targets, group=self.parallel.tp_group,
                                temperature=self.temperature)
            return torch.zeros((), device=logits.device), lp

        try:
            with self.reference_on_device():  # with objective.ref_offload: one host-to-device copy of its weights
                results = self.forward_backward(microbatches, ref, forward_only=True, models=self.reference)
        finally:
            if hook is not None:
                hook.remove()
        for mb, out in zip(microbatches if results else [], results, strict=True):
            if exact:
                mb.ref_hidden = out
            else:
                mb.ref_logprobs = out

    def rl_loss(self, mb: Batch, out, normalizer):
        """The policy loss of micro-batch mb from what the last chunk returned (its logits shard, or with
        train.fused_output_layer its hidden states): (loss contribution, metrics)."""
        beh = mb.behavior
        anchor = None if mb.anchor_logprobs is None else BehaviorTopK(beh.token_ids, mb.old_logprobs, beh.topk_ids,
                                                                      mb.anchor_logprobs)
        kw = dict(temperature=self.temperature, normalizer=normalizer, sequence_ids=mb.sequence_ids,
                  old_logprobs=mb.old_logprobs, sequence_lengths=mb.sequence_lengths, token_age=mb.token_age,
                  anchor=anchor, ref_logprobs=mb.ref_logprobs, tp_group=self.parallel.tp_group,
                  sequence_group=self.parallel.cp_group, num_sequences=mb.rows)
        if self.fused:
            result = policy_loss_from_hidden(
                mb.response_logits(out), output_weight(self.chunks[-1]), beh, mb.advantages, mb.loss_mask,
                self.cfg.objective, ref_hidden=mb.ref_hidden,
                ref_output_weight=None if mb.ref_hidden is None else self.reference_output_weight(), **kw)
        else:
            # the exact KL's pi_ref shard, as the reference's output layer computes it: one [N, H] x [H, V/tp] GEMM
            ref_logits = None if mb.ref_hidden is None else mb.ref_hidden @ self.reference_output_weight().t()
            result = policy_loss(mb.response_logits(out), beh, mb.advantages, mb.loss_mask, self.cfg.objective,
                                 ref_logits=ref_logits, **kw)
        if mb.teacher_hidden is None:
            return result.loss, result.metrics
        loss, metrics = self.distill_term(mb, out, normalizer)
        return result.loss + loss, result.metrics.merge(metrics)

    def sft_update(self, batch: Batch, n_global: int) -> float:
        """One supervised update: -sum log pi(answer tokens) / n_global over this rank's batch (one micro-batch),
        over the tokens batch.loss_mask keeps when it has one."""
        def sft_loss(mb, out):
            def token_loss(rows, lp):  # -sum log pi / n, a sum over tokens: the fused path takes it chunk by chunk
                return -(lp if mb.loss_mask is None else lp * mb.loss_mask[rows]).sum() / n_global

            z, group = mb.response_logits(out), self.parallel.tp_group
            if self.fused:
                return fused_output_loss(z, output_weight(self.chunks[-1]),
                                         lambda rows, stats, _: (token_loss(rows, stats.logprobs), None),
                                         token_ids=mb.targets, group=group).loss, Metrics()
            return token_loss(slice(None), token_logprobs(z, mb.targets, group=group)), Metrics()

        return self.update(self.micro_batches(batch, [batch.rows]), sft_loss)[0]


def at_least(sizes: list[int], n: int, *, fewest: int | None = None) -> list[int]:
    """Micro-batch sizes for megatron's interleaved schedule over n = PP stages: at least n micro-batches, and a
    multiple of n where `fewest` rows (the fewest any DP rank holds; default this one's) allow, so that megatron's
    group of n micro-batches per chunk applies (`interleave_group`) and the warm-up holds what `plan` counts. The
    largest is halved (first half first) until there are that many. The policy loss and its gradient are sums over
    micro-batches, so only their summation order changes; an MoE load-balancing loss, computed per micro-batch,
    follows the finer cut. Every DP rank gets the same count from the same `fewest`. ValueError when fewer than n."""
    sizes, fewest = list(sizes), sum(sizes) if fewest is None else fewest
    if fewest < n:
        raise ValueError(f"parallel.virtual: the interleaved schedule needs at least parallel.pipeline = {n} "
                         f"micro-batches, and a DP rank's minibatch has {fewest} sequences")
    rounded = -(-len(sizes) // n) * n
    target = rounded if rounded <= fewest else len(sizes)
    while len(sizes) < target:
        i = max(range(len(sizes)), key=lambda j: sizes[j])
        sizes[i:i + 1] = [sizes[i] - sizes[i] // 2, sizes[i] // 2]
    return sizes


def interleave_group(m: int, pp: int) -> int:
    """megatron's microbatch_group_size_per_vp_stage for m micro-batches over pp stages (m >= pp): the smallest
    group g >= pp after which the remainder m % g is 0 or at least pp, as its interleaved schedule requires; the
    smallest keeps the fewest micro-batches in flight (warm-up: 2 (pp - rank - 1) + (virtual - 1) g). Unused
    without virtual stages."""
    return next((g for g in range(pp, m + 1) if m % g == 0 or m % g >= pp), max(m, pp))
