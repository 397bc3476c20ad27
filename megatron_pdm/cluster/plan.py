"""`megatron-pdm plan`: does a config fit, and with which parallelism, before anything is launched.

Pure pieces, each on a `Config` (no process group, no GPU):

- `count_parameters(model)`: exact parameter counts, total and active per token, module by module as megatron-core
  builds the GPTModel (tests compare them with the count of a built model and with published totals).
- `training_memory(cfg, layout)`: per-GPU bytes of the most loaded pipeline stage, by item (weights, gradients,
  optimizer states, activations, the TP-sharded logits, what PDM adds on top of them, per micro-batch of
  `micro_batch_positions`: micro_batch_size rows, or the token budget); stages may hold uneven layer
  counts (`models.pipeline_layer_counts`), the embedding on the first and the output layer on the last. `plan` adds
  the weight sync's buffers (`train.weight_sync.weight_sync_peak_bytes`).
- `host_memory(cfg, layout, gpus_per_node)`: host bytes per training node (the CPU-offloaded optimizer share,
  checkpoint staging, per-process runtime).
- `rollout_memory(cfg, gpu)`: an SGLang engine's weights and the KV-cache tokens that fit beside them.

The layouts themselves (`Layout`, `layout_of`, `layout_problem`: megatron's rules) live in `models.layout`, below
the trainer's config checks, which use them too. `plan(cfg, nodes, gpu)` ranks every valid TP / PP / EP / CP / DP
factorisation the way megatron's MoE guidance orders them: expert all-to-alls (EP x ETP) inside a node's NVLink
domain, pipeline stages across nodes, context parallelism for long sequences. Units: 1 GB = 2**30 bytes, as
`nvidia-smi` and `torch.cuda.memory_allocated` count. The activation model is for the GPU path (Transformer
Engine, flash attention: no [S, S] scores are stored) and counts the tensors each sub-layer saves for backward.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass, field, replace

from megatron_pdm._validate import check_choice, check_int, check_number, is_int
from megatron_pdm.models import ModelConfig, ParallelConfig, pipeline_layer_counts, stage_layer_indices
from megatron_pdm.models.families import layer_tensors, model_tensors, numel
from megatron_pdm.models.layout import Layout, layout_of, layout_problem  # (also importable from here)
from megatron_pdm.rollout.engines import engine_spec
from megatron_pdm.rollout.sglang.launcher import attention_dp
from megatron_pdm.train.weight_sync import weight_sync_peak_bytes

GB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float  # what the device reports, GiB
    host_memory_gb: float  # host memory of the standard 8-GPU node (DGX / HGX), GiB


GPUS = {
    "h100": GPU("H100 SXM 80GB", 79.6, 2048),  # 81,559 MiB; DGX H100: 2 TB
    "h200": GPU("H200 SXM 141GB", 140.4, 2048),  # 143,771 MiB; DGX H200: 2 TB
    "b200": GPU("B200 180GB", 178.4, 4096),  # 182,681 MiB; DGX B200: 4 TB
}
# Of a GPU's memory, the part a plan may fill: the rest is the CUDA context, NCCL buffers and allocator
# fragmentation (megatron runs typically see 3-8 GB of these on an 80 GB device).
USABLE_FRACTION = 0.9
# Of a node's host memory, the part a plan may fill: the rest is the OS, the page cache that checkpoint and
# dataset reads go through, and pinned staging buffers.
HOST_USABLE_FRACTION = 0.8
# Host memory of each GPU process beside what is modelled (Python, the CUDA context's host side, NCCL proxies,
# the data loader): megatron ranks typically hold 5-15 GiB resident.
HOST_RUNTIME_GB_PER_PROCESS = 12.0
# SGLang's default --mem-fraction-static on large GPUs: weights plus KV pool; the rest is activations and graphs.
SGLANG_MEM_FRACTION_STATIC = 0.85

# bytes per parameter by training precision: the weights megatron computes with (fp8: the bf16 weights plus the
# fp8 copy Transformer Engine caches for forward and backward)
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 3}
GRAD_BYTES = 4  # the DDP gradient buffer is fp32 (grad_reduce_in_fp32, as the trainer sets it)
ADAM_BYTES = {"fp32": 8, "bf16": 12, "fp16": 12, "fp8": 12}  # (fp32 main params +) exp_avg + exp_avg_sq
OFFLOADED_GRAD_BYTES = 4  # the fp32 copy of the gradients a CPU optimizer steps on (megatron's hybrid optimizer)
ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # TE keeps saved activations in bf16 under fp8 too
KV_BYTES = {"auto": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


# --------------------------------------------------------------------------------------------------------------
# parameter counts


@dataclass(frozen=True)
class ParameterCount:
    embedding: int  # input embedding
    output: int  # output layer (0 when tied to the embedding)
    final_norm: int
    attention: list[int]  # per layer: attention projections, its norms and the layer's input norm
    dense_mlp: list[int]  # per layer: pre-MLP norm + dense MLP (0 on MoE layers)
    router: list[int]  # per layer (0 on dense layers)
    shared_expert: list[int]  # per layer
    routed_expert: int  # one routed expert's parameters
    experts_per_layer: list[int]  # routed experts per layer (0 on dense layers)
    moe_topk: int

    @property
    def total(self) -> int:
        return (self.embedding + self.output + self.final_norm + sum(self.attention) + sum(self.dense_mlp)
                + sum(self.router) + sum(self.shared_expert) + self.routed_expert * sum(self.experts_per_layer))

    @property
    def active(self) -> int:
        """Parameters one token passes through: everything but the routed experts it is not sent to."""
        routed = self.routed_expert * self.moe_topk * sum(1 for e in self.experts_per_layer if e)
        return self.total - self.routed_expert * sum(self.experts_per_layer) + routed

    def layer(self, i: int, *, experts: bool = True) -> int:
        return (self.attention[i] + self.dense_mlp[i] + self.router[i] + self.shared_expert[i]
                + (self.routed_expert * self.experts_per_layer[i] if experts else 0))


def _replicated_per_layer(m: ModelConfig) -> int:
    """Parameters of a layer that every TP rank holds whole: its two norms and the norms inside attention
    (Qwen3's QK-norm, MLA's query and KV latent norms)."""
    inner = m.q_lora_rank + m.kv_lora_rank if m.multi_latent_attention else 2 * m.head_dim * m.qk_norm
    return 2 * m.hidden_size + inner


def count_parameters(m: ModelConfig) -> ParameterCount:
    """Exact parameter counts of megatron-core's GPTModel for `m`, summed from the family's tensor list
    (`families.layer_tensors`; the layer norms fused into TE linears count the same). Router expert biases are
    buffers in megatron-core, not parameters, and are not counted."""
    L = m.num_layers
    kinds = {}  # a layer's tensors depend on i only through is_moe_layer(i) (families.Family.layer)
    for i in range(L):
        if (moe := m.is_moe_layer(i)) not in kinds:
            kinds[moe] = _layer_parts(m, i)
    layers = [kinds[m.is_moe_layer(i)] for i in range(L)]
    head, tail = model_tensors(m, first=True, last=True)
    model = {t.part: numel(t) for t in head + tail}
    first_moe = layer_tensors(m, m.moe_first_k_dense) if m.is_moe else []  # is_moe_layer(i): i >= first_k_dense
    return ParameterCount(
        embedding=model["embedding"],
        output=model.get("output", 0),
        final_norm=model["final_norm"],
        attention=[p["attention"] for p in layers],
        dense_mlp=[p["dense_mlp"] for p in layers],
        router=[p["router"] for p in layers],
        shared_expert=[p["shared_expert"] for p in layers],
        routed_expert=sum(numel(t) for t in first_moe if t.megatron.endswith("#0")),  # one expert's
        experts_per_layer=[m.num_experts if m.is_moe_layer(i) else 0 for i in range(L)],
        moe_topk=m.moe_router_topk if m.is_moe else 0,
    )


def _layer_parts(m: ModelConfig, i: int) -> dict[str, int]:
    """Layer i's parameters by the part they count as (all routed experts together under "routed_expert")."""
    parts = dict.fromkeys(("attention", "dense_mlp", "router", "shared_expert", "routed_expert"), 0)
    for t in layer_tensors(m, i):
        parts[t.part] += numel(t) if t.parameter else 0
    return parts


# --------------------------------------------------------------------------------------------------------------
# training memory


def auto_stage_layers(num_layers: int, pp: int) -> tuple[int, int]:
    """(first_stage_layers, last_stage_layers) for `num_layers` over `pp` stages: (0, 0), an even split, when pp
    divides them; else the middle stages take m = ceil(L / pp) layers each and the first and last stages, which also
    hold the embedding and the output layer with its [T, V/tp] logits, share the rest r = L - (pp - 2) m, the last
    taking floor(r / 2) (<= m). DeepSeek-V3's 61 layers: PP16 -> 3 + 14 x 4 + 2 (Megatron-Bridge's layout), PP8 ->
    7 + 6 x 8 + 6 (NeMo-RL's); Qwen3-235B's 94 over PP8 -> 11 + 6 x 12 + 11. ValueError when no such split exists."""
    if pp == 1 or num_layers % pp == 0:
        return 0, 0
    middle = -(-num_layers // pp)
    rest = num_layers - (pp - 2) * middle
    if pp == 2:
        rest, middle = num_layers, num_layers
    if rest < 2:
        raise ValueError(f"model.num_layers = {num_layers} over parallel.pipeline = {pp}: no split with at least one "
                         "layer per stage and no more on the first / last stage than on the others; use fewer "
                         "pipeline stages, or set parallel.first_stage_layers / last_stage_layers")
    return rest - rest // 2, rest // 2


def _activation_elements_per_token(m: ModelConfig, moe: bool) -> float:
    """Elements one layer saves for backward per token (before TP / sequence-parallel sharding): the residual and
    norm inputs, the attention's inputs and outputs (flash attention keeps q, k, v, out, and a [heads] log-sum-exp),
    the MLP's fc1 input, its gate/up output and the SwiGLU output; an MoE layer keeps them for each of its top-k
    routed copies of the token, plus the fp32 router probabilities (counted as two elements each)."""
    h, n, d = m.hidden_size, m.num_attention_heads, m.head_dim
    if m.multi_latent_attention:
        q = (m.q_lora_rank or 0) + n * (d + m.qk_rope_head_dim)
        kv = m.kv_lora_rank + m.qk_rope_head_dim + n * (d + m.qk_rope_head_dim) + n * m.v_head_dim
        attention = 2 * h + q + kv + n * m.v_head_dim + n
    else:
        attention = 2 * h + 2 * (n + m.num_query_groups) * d + 2 * n * d + n
    if not moe:
        return attention + 2 * h + 3 * m.ffn_hidden_size
    routed = m.moe_router_topk * (h + 3 * m.moe_ffn_hidden_size)
    shared = h + 3 * m.moe_shared_expert_ffn_hidden_size if m.moe_shared_expert_ffn_hidden_size else 0
    return attention + 2 * h + 2 * m.num_experts + routed + shared


@dataclass
class Memory:
    """Bytes per GPU, by item. The states (weights, gradients, GPU optimizer states) stay all along; the
    activations, logits and PDM buffers live during the forward / backward passes, and the weight sync's buffers
    (`weight_sync_peak_bytes`) after the optimizer step, when those are freed: `total` is the states plus the
    larger of the two."""

    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    reference: float = 0.0  # the frozen reference policy (objective.kl_coef): a second copy of the weights
    activations: float = 0.0
    logits: float = 0.0  # the output layer's [tokens, V/tp] logits and gradient; fused: a chunk and the gradients
    logits_forward: float = 0.0  # what a forward-only pass's output layer holds (the reference pass)
    pdm: float = 0.0
    weight_sync: float = 0.0
    # an offloaded reference's weights (objective.ref_offload), on the GPU during its forward pass only, beside that
    # pass's logits shard (its activations are freed layer by layer: no backward)
    reference_pass: float = 0.0
    # routed-expert replay (rollout.routed_experts): the step's expert choices for the stage's MoE layers, on the
    # GPU from the step's batches to its last update
    routed_experts: float = 0.0

    @property
    def states(self) -> float:
        return self.weights + self.grads + self.optimizer + self.reference

    @property
    def total(self) -> float:
        return self.states + self.routed_experts + max(
            self.activations + self.logits + self.pdm, self.weight_sync,
            self.reference_pass + (self.logits_forward if self.reference_pass else 0.0))

    @property
    def beside_engines(self) -> float:
        """What colocated engines share the GPU with while they hold their memory (from the weight sync to the
        next step's release): the states, and the sync's buffers or, at a checkpoint, an offloaded reference."""
        return self.states + max(self.weight_sync, self.reference_pass)

    def gb(self) -> dict:
        return {**{k: round(v / GB, 3) for k, v in asdict(self).items()}, "total": round(self.total / GB, 3)}


def sequence_length(cfg) -> int:
    """Tokens of one training sequence at most: the longest prompt plus the longest response."""
    return cfg.data.max_prompt_length + cfg.rollout.max_new_tokens


def micro_batch_positions(cfg) -> int:
    """Positions (rows x padded width) of the largest micro-batch the trainer computes, before context parallelism:
    train.micro_batch_size x the longest sequence; with a token budget (train.max_tokens_per_microbatch)
    max(budget, longest sequence), as `train.batch.pack_by_tokens` packs: rows sorted by length while rows x
    longest <= budget, and a sequence longer than the budget alone (micro_batch_size is then unused). The budget
    can hold many more positions than micro_batch_size rows, so everything that scales with a micro-batch
    (activations, logits, PDM statistics, MoE routing) is sized by it. Not counted: the width's rounding up to
    parallel.sequence_multiple, and plan_micro_batches' merge of two bins, which it makes only when a minibatch's
    rows are fewer than the next multiple of DP above its bin count (rows per minibatch not a multiple of DP,
    e.g. after dynamic sampling dropped groups)."""
    seq = sequence_length(cfg)
    budget = cfg.train.max_tokens_per_microbatch
    return cfg.train.micro_batch_size * seq if budget is None else max(budget, seq)


def micro_batch_text(cfg) -> str:
    """How the plan sizes a micro-batch, in words."""
    seq, budget = sequence_length(cfg), cfg.train.max_tokens_per_microbatch
    if budget is None:
        return (f"micro-batch: train.micro_batch_size {cfg.train.micro_batch_size} x {seq:,}-token sequences = "
                f"{micro_batch_positions(cfg):,} positions")
    alone = f" (a {seq:,}-token sequence, longer than the budget, goes alone)" if seq > budget else ""
    return (f"micro-batch: sized by the token budget train.max_tokens_per_microbatch = {budget:,}: up to "
            f"{micro_batch_positions(cfg):,} positions{alone}; train.micro_batch_size is unused")


def pdm_bytes(tokens: int, vocab_shard: int, top_k: int, *, rows: int | None = None) -> float:
    """What the masks add beside the logits, per micro-batch of `tokens` response tokens: the rollout's top-K ids
    (int64) and log-probs (fp32), the sampled token's id and log-prob, the packed [T, K+4] fp32 partial sums, about
    eight fp32 per-token statistics (log Z, log pi(k), entropy, D, Ddot, masks, ratio), and the two fp32 work
    buffers of one sub-chunk (vocab_parallel.core.SUB_CHUNK_BYTES on a GPU) of the `rows` logits rows that exist at
    once (all of them; with the fused output layer a chunk's)."""
    from megatron_pdm.vocab_parallel.core import SUB_CHUNK_BYTES

    per_token = top_k * (8 + 4) + (8 + 4) + (top_k + 4) * 4 + 8 * 4
    return tokens * per_token + 2 * min(SUB_CHUNK_BYTES["cuda"], (tokens if rows is None else rows) * vocab_shard * 4)


def fused_output_bytes(tokens: int, vocab_shard: int, hidden: int, *, exact_kl: bool) -> tuple[float, float]:
    """(training pass, forward-only pass) bytes of the fused output layer (train.fused_output_layer) for a
    micro-batch of `tokens` response tokens: a chunk of logits rows (vocab_parallel.fused.default_chunk_rows on a
    GPU) in bf16 and its gradient (the Triton kernel writes a buffer of its own) and, with the exact KL, the
    reference's chunk and its gradient term; the
    gradients taken in the forward that wait for the backward, fp32 [tokens, H] and [V/tp, H]; and a chunk's bf16
    weight-gradient GEMM result [V/tp, H] before it joins the fp32 sum."""
    from megatron_pdm.vocab_parallel.fused import default_chunk_rows

    rows = min(tokens, default_chunk_rows(vocab_shard, "cuda"))
    chunk = rows * vocab_shard * (2 + 2 + (2 + 2 if exact_kl else 0))
    return chunk + (tokens + vocab_shard) * hidden * 4 + vocab_shard * hidden * 2, rows * vocab_shard * 2


def _stage_parameters(m: ModelConfig, counts: ParameterCount, layers: list[int], *, first: bool, last: bool,
                      pp: int) -> tuple[float, float, float]:
    """A stage's parameters: (TP-sharded dense, replicated over TP, routed experts), before any sharding."""
    replicated = sum(_replicated_per_layer(m) + counts.router[i] for i in layers)
    dense = sum(counts.layer(i, experts=False) for i in layers) - replicated
    if first:
        dense += counts.embedding
    if last:
        dense += counts.output + (counts.embedding if counts.output == 0 and pp > 1 else 0)
        replicated += counts.final_norm
    experts = sum(counts.experts_per_layer[i] for i in layers) * counts.routed_expert
    return dense, replicated, experts


def _optimizer_shard(cfg, layout: Layout, dense_local: float, expert_local: float) -> float:
    """Parameters whose optimizer state this rank holds: all its local ones, or with the distributed optimizer its
    1 / (DP x CP) share of the dense ones and 1 / expert-DP share of the experts."""
    if not cfg.optim.distributed_optimizer:
        return dense_local + expert_local
    return dense_local / (layout.dp * layout.cp) + expert_local / layout.edp


def stage_memory(cfg, layout: Layout, stage: int) -> Memory:
    """Per-GPU bytes of pipeline stage `stage` under `layout`.

    weights + grads: the stage's dense parameters / TP (norms and routers replicated) and its routed experts
    / (EP x ETP), the embedding on the first stage, the output layer (or the tied embedding's copy) on the last;
    optimizer: Adam states (with fp32 main parameters unless training in fp32) of the rank's shard (sharded over
    DP x CP for dense and expert-DP for experts under optim.distributed_optimizer), times (1 - optim.cpu_offload);
    activations: 1F1B keeps (PP - stage) micro-batches in flight (`_stage_micro_batches_in_flight`: more with
    virtual stages), each saving its layers' activations of `micro_batch_positions` / CP tokens (micro_batch_size
    x seq, or with a token budget max(budget, seq)), / TP under sequence parallelism (with full recompute only
    each layer's input, plus one layer recomputed at a time); logits (last stage): the bf16 [tokens, V/TP] shard
    and its gradient, or with train.fused_output_layer a chunk of it (`fused_output_bytes`); pdm: `pdm_bytes`;
    reference: the KL penalty's frozen copy of the weights (objective.kl_coef;
    none on the GPU with objective.ref_offload, but `reference_pass`), and for the exact KL its last hidden states
    over the minibatch and its logits shard per micro-batch; routed_experts (R3): int16 [rows, seq, the stage's MoE
    layers, top_k] of the DP rank's rows of the whole step (an even share: under token budgets a rank may hold more
    rows, each padded to its share's longest). The allgather dispatcher adds, one layer at a time, the tokens of its
    EP x ETP group and their routing, gathered before each rank keeps its own experts' (alltoall and flex send
    each token only to its experts, which the layer's routed copies count)."""
    m, p = cfg.model, cfg.precision.train
    counts = count_parameters(m)
    layers = stage_layer_indices(m.num_layers, layout.parallel, stage)
    last = stage == layout.pp - 1
    dense, replicated, experts = _stage_parameters(m, counts, layers, first=stage == 0, last=last, pp=layout.pp)
    dense_local = dense / layout.tp + replicated
    expert_local = experts / (layout.ep * layout.etp)
    tokens = micro_batch_positions(cfg) // layout.cp
    shard_tokens = tokens / layout.tp  # sequence parallelism
    vocab_shard = m.vocab_size // layout.tp
    mem = Memory()
    mem.weights = (dense_local + expert_local) * WEIGHT_BYTES[p]
    # the reference's weights; offloaded, on the GPU only during its forward pass (with the activations then freed)
    mem.reference = mem.weights if cfg.objective.needs_reference and not cfg.objective.ref_offload else 0.0
    mem.reference_pass = mem.weights if cfg.objective.ref_offload else 0.0
    teacher_weights, teacher_hidden = _teacher_bytes(cfg, layout)
    if teacher_weights:  # the in-trainer teacher (distill.teacher): a frozen model, counted as the reference is
        offload = cfg.distill.teacher_offload
        mem.reference += (0.0 if offload else teacher_weights) + (teacher_hidden if last else 0.0)
        mem.reference_pass = max(mem.reference_pass, teacher_weights if offload else 0.0)
    mem.grads = (dense_local + expert_local) * GRAD_BYTES
    mem.optimizer = (1 - cfg.optim.cpu_offload) * ADAM_BYTES[p] * _optimizer_shard(cfg, layout, dense_local,
                                                                                     expert_local)
    in_flight = _stage_micro_batches_in_flight(cfg, layout, stage)
    act = ACT_BYTES[p]
    per_layer = [_activation_elements_per_token(m, m.is_moe_layer(i)) * shard_tokens * act for i in layers]
    if cfg.train.recompute == "full":
        mem.activations = in_flight * len(layers) * m.hidden_size * shard_tokens * act + max(per_layer)
    else:
        mem.activations = in_flight * sum(per_layer)
    moe_layers = sum(map(m.is_moe_layer, layers))
    if moe_layers and m.moe_token_dispatcher_type == "allgather":  # [tokens, H] and the fp32 probs + bool map
        mem.activations += shard_tokens * layout.ep * layout.etp * (m.hidden_size * act + m.num_experts * 5)
    if cfg.rollout.routed_experts:
        rows = -(-cfg.train.prompts_per_step * cfg.rollout.n // layout.dp)
        mem.routed_experts = rows * sequence_length(cfg) * moe_layers * m.moe_router_topk * 2
    if last:
        exact_kl = cfg.objective.needs_reference and cfg.objective.kl_type == "exact"
        if cfg.train.fused_output_layer:
            mem.logits, mem.logits_forward = fused_output_bytes(tokens, vocab_shard, m.hidden_size, exact_kl=exact_kl)
            rows = int(mem.logits_forward // (vocab_shard * 2))
        else:
            mem.logits, mem.logits_forward, rows = 2 * tokens * vocab_shard * 2, tokens * vocab_shard * 2, None
        mem.pdm = pdm_bytes(tokens, vocab_shard, cfg.objective.top_k, rows=rows)
        if exact_kl:
            # the reference's logits shard of a micro-batch, kept for the KL's backward (not with the fused output
            # layer); its last hidden states over a rank's minibatch (every response position at most: a sequence's
            # positions); and, offloaded, its output weight shard, which stays on the GPU
            mem.logits += 0 if cfg.train.fused_output_layer else tokens * vocab_shard * 2
            t = cfg.train
            rows = -(-t.prompts_per_step * cfg.rollout.n // (t.minibatches * layout.dp))
            mem.reference += rows * sequence_length(cfg) / layout.cp * m.hidden_size * ACT_BYTES[p]
            if cfg.objective.ref_offload:
                mem.reference += vocab_shard * m.hidden_size * WEIGHT_BYTES[p]
    return mem


def _teacher_bytes(cfg, layout: Layout) -> tuple[float, float]:
    """(the in-trainer teacher's weights on a rank: all its parameters / TP, its pipeline size being 1; its last
    hidden states over a rank's minibatch, kept for the loss) in bytes; (0, 0) without a teacher, or when its
    checkpoint directory is not visible here (a cluster path: the trainer checks it at start)."""
    from pathlib import Path

    d = cfg.distill
    if not d.enabled or not Path(d.teacher).is_dir():
        return 0.0, 0.0
    tm, p = d.teacher_model(cfg.model), cfg.precision.train
    t = cfg.train
    rows = -(-t.prompts_per_step * cfg.rollout.n // (t.minibatches * layout.dp))
    return (count_parameters(tm).total / layout.tp * WEIGHT_BYTES[p],
            rows * sequence_length(cfg) / layout.cp * tm.hidden_size * ACT_BYTES[p])


def _stage_micro_batches_in_flight(cfg, layout: Layout, stage: int) -> float:
    """Micro-batches whose activations stage `stage` holds at once, in units of its whole layers, with M the
    trainer's micro-batches per minibatch and rank (micro_batch_size rows; with virtual stages cut as
    `train.step.at_least` cuts them): min(PP - stage, M) under 1F1B; with V virtual stages megatron's interleaved
    warm-up of 2 (PP - stage - 1) + (V - 1) g chunk passes plus one, at most M V, each chunk 1 / V of the stage
    (g = PP when PP divides M: on the first stage 1 + (PP - 1) / (PP V) times 1F1B's).

    With a token budget M depends on the lengths. Each micro-batch computes at most `micro_batch_positions`, and a
    rank's bins are dealt to it largest first (`plan_micro_batches`), so the warm-up can hold that many positions
    in every micro-batch in flight: the bound is the largest micro-batch times the most micro-batches in flight
    over every M the trainer can cut, which is at most the rows of a rank (one row per bin:
    `_most_token_budget_micro_batches`); with virtual stages the largest count over M in [PP, that] (`at_least`
    keeps M in that range, and the warm-up is not monotone in M)."""
    from megatron_pdm.train.batch import plan_minibatches
    from megatron_pdm.train.step import at_least

    pp, v, t = layout.pp, layout.virtual, cfg.train
    if t.max_tokens_per_microbatch is not None:
        most = _most_token_budget_micro_batches(t.prompts_per_step, cfg.rollout.n, t.minibatches,
                                                t.filter_groups != "none" and not t.refill, layout.dp,
                                                pp if v > 1 else 1)
        return min(pp - stage, most) if v == 1 else _most_interleaved_in_flight(pp, v, stage, most)
    # the trainer's cut of a DP rank's share of one minibatch (one row at least)
    sizes = plan_minibatches([0] * (t.prompts_per_step * cfg.rollout.n), minibatches=t.minibatches, ranks=layout.dp,
                             micro_batch_size=t.micro_batch_size)[0][0][1] or [1]
    rows = sum(sizes)
    if v == 1:
        return min(pp - stage, len(sizes))
    m = len(at_least(sizes, pp)) if rows >= pp else pp  # fewer rows: the config refuses the layout
    return _interleaved_in_flight(m, pp, v, stage)


def _interleaved_in_flight(m: int, pp: int, v: int, stage: int) -> float:
    """Stage `stage`'s chunk passes in flight under megatron's interleaved schedule of m micro-batches, in units of
    whole stages (see `_stage_micro_batches_in_flight`)."""
    from megatron_pdm.train.step import interleave_group

    return min(2 * (pp - stage - 1) + (v - 1) * interleave_group(m, pp) + 1, m * v) / v


@functools.cache
def _most_interleaved_in_flight(pp: int, v: int, stage: int, most: int) -> float:
    """The largest `_interleaved_in_flight` over m = PP .. most micro-batches (PP when most is smaller: the config
    refuses such a layout)."""
    return max(_interleaved_in_flight(m, pp, v, stage) for m in range(pp, max(pp, most) + 1))


@functools.cache
def _most_token_budget_micro_batches(prompts: int, n: int, minibatches: int, drops: bool, dp: int,
                                     per_rank: int) -> int:
    """The most micro-batches a DP rank can run in one minibatch under a token budget: plan_micro_batches gives
    each rank bins / DP bins of at least one row, and bins <= the minibatch's rows, so at most rows // DP. The
    minibatch's rows: prompts x n over `minibatches`, the largest ceil(N / count) of plan_minibatches' cut of N
    rows into count = min(minibatches, N // (DP x per_rank)); N = prompts x n, or with dynamic sampling (`drops`:
    train.filter_groups without refill) any whole number of groups of n, whose fewer minibatches can be larger
    (up to 2 DP per_rank - 1 rows). At least 1."""
    most = 1
    for rows in range(n, prompts * n + 1, n) if drops else (prompts * n,):
        count = min(minibatches, rows // (dp * per_rank))
        if count:
            most = max(most, -(-rows // count) // dp)
    return most


def training_memory(cfg, layout: Layout) -> tuple[Memory, int]:
    """Per-GPU bytes on the most loaded pipeline stage under `layout` (`stage_memory` of every stage), and that
    stage's index."""
    mems = [stage_memory(cfg, layout, stage) for stage in range(layout.pp)]
    stage = max(range(layout.pp), key=lambda i: mems[i].total)
    return mems[stage], stage


@dataclass
class HostMemory:
    """Host bytes per training node, by item; `total` is their sum."""

    optimizer: float = 0.0  # the CPU-offloaded optimizer share: fp32 main parameters, Adam states, fp32 gradients
    checkpoint: float = 0.0  # a checkpoint's CPU staging: each rank's weights and GPU optimizer states (torch.save)
    reference: float = 0.0  # the reference policy's weights, pinned (objective.ref_offload)
    runtime: float = 0.0  # HOST_RUNTIME_GB_PER_PROCESS for every training rank and colocated engine rank
    # R3: the int32 routed experts [tokens, layers, top_k] of the samples rank 0 holds (the step's, and under the
    # lagged schedule the rollout.lag steps' waiting), counted on every node: an upper bound for all but the first
    routed_experts: float = 0.0

    @property
    def total(self) -> float:
        return self.optimizer + self.checkpoint + self.reference + self.runtime + self.routed_experts

    def gb(self) -> dict:
        return {**{k: round(v / GB, 1) for k, v in asdict(self).items()}, "total": round(self.total / GB, 1)}


def host_memory(cfg, layout: Layout, gpus_per_node: int, *, colocated: bool) -> HostMemory:
    """Host bytes per training node: gpus_per_node ranks of the stage whose ranks hold the most (an upper bound
    when a node holds ranks of several stages). Per rank: optimizer = cpu_offload x shard x (ADAM_BYTES + 4) (the
    hybrid CPU optimizer steps on fp32 copies of its gradients); checkpoint = its weights and the GPU share of its
    optimizer states, which torch.save stages in host memory; runtime per process (twice with colocated engines);
    routed_experts (R3) on rank 0's node."""
    m, p = cfg.model, cfg.precision.train
    counts = count_parameters(m)
    per_stage = layout.stage_layers(m.num_layers)
    worst = HostMemory()
    for stage in range(layout.pp):
        start = sum(per_stage[:stage])
        dense, replicated, experts = _stage_parameters(m, counts, range(start, start + per_stage[stage]),
                                                       first=stage == 0, last=stage == layout.pp - 1, pp=layout.pp)
        dense_local = dense / layout.tp + replicated
        expert_local = experts / (layout.ep * layout.etp)
        shard = _optimizer_shard(cfg, layout, dense_local, expert_local)
        f = cfg.optim.cpu_offload
        h = HostMemory(
            optimizer=gpus_per_node * f * shard * (ADAM_BYTES[p] + OFFLOADED_GRAD_BYTES),
            checkpoint=gpus_per_node * ((dense_local + expert_local) * WEIGHT_BYTES[p]
                                        * (2 if cfg.objective.needs_reference else 1)  # + the reference's copy
                                        + (1 - f) * shard * ADAM_BYTES[p]),
            reference=gpus_per_node * (dense_local + expert_local) * WEIGHT_BYTES[p] * cfg.objective.ref_offload,
            runtime=gpus_per_node * (2 if colocated else 1) * HOST_RUNTIME_GB_PER_PROCESS * GB,
            routed_experts=(1 + cfg.lag) * cfg.train.prompts_per_step * cfg.rollout.n * sequence_length(cfg)
            * m.num_layers * m.moe_router_topk * 4 if cfg.rollout.routed_experts else 0.0)
        if h.total > worst.total:
            worst = h
    return worst


# --------------------------------------------------------------------------------------------------------------
# rollout memory


def kv_bytes_per_token(m: ModelConfig, kv_cache: str, engine_tp: int) -> float:
    """KV-cache bytes per token on one GPU of an engine: K and V of every layer's KV heads on this GPU (heads are
    split over the engine's TP, and replicated when there are fewer heads than GPUs); multi-latent attention
    caches the compressed latent and the RoPE key, replicated on every GPU (SGLang's MLA layout)."""
    b = KV_BYTES[kv_cache]
    if m.multi_latent_attention:
        return m.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * b
    heads = max(1, m.num_query_groups // engine_tp)
    return m.num_layers * 2 * heads * m.head_dim * b


def rollout_weight_bytes(m: ModelConfig, precision: str) -> float:
    """An engine's weights: fp8 rollout quantizes the linear layers (1 byte each, plus one fp32 scale per 128x128
    block); embeddings, the output layer and the norms stay bf16."""
    c = count_parameters(m)
    if precision != "fp8":
        return c.total * (4 if precision == "fp32" else 2)
    unquantized = c.embedding + c.output + c.final_norm + m.num_layers * 2 * m.hidden_size
    linear = c.total - unquantized
    return linear * (1 + 4 / 128**2) + unquantized * 2


def attention_dp_size(cfg) -> int:
    """The SGLang engines' DP-attention size: rollout.sglang.server_args' --dp-size under --enable-dp-attention
    (attention runs data-parallel over dp groups of rollout_tp / dp GPUs, the MoE layers over all rollout_tp), else
    1."""
    return attention_dp(cfg.rollout.sglang.server_args, cfg.cluster.rollout_tp, "cluster.rollout_tp")


@dataclass
class RolloutPlan:
    engines: int
    gpus_per_engine: int
    attention_dp: int  # SGLang's DP-attention size (1: attention is tensor-parallel over the whole engine)
    mem_fraction_static: float  # of each GPU, for the engine's weights and KV pool (SGLang's flag; never < 0)
    weights_gb_per_gpu: float
    kv_bytes_per_token: float  # on one GPU
    kv_tokens_per_engine: int
    sequences_per_engine: int  # that fit at full length (prompt + response)
    needed_sequences_per_engine: int  # one step's rollouts / engines
    fits: bool
    problem: str | None = None  # why it does not fit
    environment: str = ""  # where the engines run (the engine spec's `environment`)


def rollout_memory(cfg, gpu: GPU, *, engines: int, beside: float = 0.0) -> RolloutPlan:
    """SGLang engines of cluster.rollout_tp GPUs each: weights / TP per GPU, and the KV pool beside them within
    mem_fraction_static of the GPU. `beside`: bytes per GPU the trainer keeps beside the engines' memory
    (colocated engines: its weights, gradients and GPU optimizer states, and the weight sync's buffers; the engines
    release their memory while it trains), which lowers mem_fraction_static from SGLang's default to what is left
    of the usable memory: floor(100 (0.9 capacity - beside) / capacity) / 100, and 0 ("does not fit") when nothing
    is left. With DP attention (dp groups) each group of tp / dp GPUs caches its own requests' KV: an engine holds
    dp x pool / per-GPU KV bytes per token tokens, where an MLA latent is no longer replicated over all tp GPUs."""
    m, tp = cfg.model, cfg.cluster.rollout_tp
    dp = attention_dp_size(cfg)
    weights = rollout_weight_bytes(m, cfg.precision.rollout) / tp
    per_token = kv_bytes_per_token(m, cfg.precision.kv_cache, tp // dp)
    capacity = gpu.memory_gb * GB
    fraction = SGLANG_MEM_FRACTION_STATIC
    if beside:
        fraction = max(0.0, min(fraction, math.floor(100 * (capacity * USABLE_FRACTION - beside) / capacity) / 100))
    pool = capacity * fraction - weights
    kv_tokens = max(0, dp * int(pool / per_token))
    seq = sequence_length(cfg)
    needed = math.ceil(cfg.train.prompts_per_step * cfg.rollout.n / engines)
    fits_seqs = kv_tokens // seq
    problem = None
    if fraction <= 0:
        problem = (f"the trainer keeps {beside / GB:,.1f} GB per GPU beside the colocated engines, leaving them no "
                   "room (mem_fraction_static would be <= 0)")
    elif pool <= 0:
        problem = (f"engine weights {weights / GB:,.1f} GB per GPU exceed mem_fraction_static {fraction:.2f} of the "
                   f"GPU ({capacity * fraction / GB:,.1f} GB)")
    elif fits_seqs < 1:
        problem = f"the KV pool holds {kv_tokens:,} tokens, less than one {seq:,}-token sequence"
    return RolloutPlan(engines, tp, dp, fraction, round(weights / GB, 3), per_token, kv_tokens, fits_seqs, needed,
                       fits=problem is None, problem=problem)


# --------------------------------------------------------------------------------------------------------------
# layouts


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(m: ModelConfig, world: int, gpus_per_node: int, seq: int) -> list[Layout]:
    """Every valid factorisation: TP and ETP within a node (their collectives are per layer), CP up to 8, any PP up
    to the layer count (uneven stages by `auto_stage_layers` where PP does not divide the layers)."""
    out = []
    pps = [pp for pp in range(1, m.num_layers + 1) if world % pp == 0]
    for tp, pp, cp in itertools.product(_divisors(gpus_per_node), pps, (1, 2, 4, 8)):
        if world % (tp * pp * cp):
            continue
        try:
            first, last = auto_stage_layers(m.num_layers, pp)
        except ValueError:
            continue
        dp = world // (tp * pp * cp)
        eps = _divisors(m.num_experts) if m.is_moe else [1]
        etps = sorted({1, tp}) if m.is_moe else [tp]
        for ep, etp in itertools.product(eps, etps):
            lay = Layout(tp, pp, ep, cp, dp, etp, first, last)
            if layout_problem(m, lay, seq) is None:
                out.append(lay)
    return out


TIGHT_FRACTION = 0.85  # a layout above this share of the usable memory has no room for a longer batch or a spike
LONG_SEQUENCE = 16384  # tokens from which context parallelism is preferred to pipeline stages


def _rank_key(lay: Layout, mem_gb: float, usable_gb: float, gpus_per_node: int, seq: int):
    """megatron's MoE guidance, in order: layouts with headroom; expert all-to-alls inside a node (EP x ETP within
    NVLink); the fewest pipeline stages and context ranks together (bubbles, ring attention), of which context
    ranks first for long sequences (>= LONG_SEQUENCE tokens: they split activations) and pipeline stages first
    otherwise (they split the weights across nodes); the smallest TP (per-layer all-reduces); the fewest expert
    peers; less memory."""
    split_last = lay.pp if seq >= LONG_SEQUENCE else lay.cp
    return (mem_gb > TIGHT_FRACTION * usable_gb, lay.expert_a2a_crosses_nodes(gpus_per_node), lay.pp * lay.cp,
            split_last, lay.tp, lay.ep * lay.etp, mem_gb)


@dataclass
class Plan:
    gpu: GPU
    nodes: int
    gpus_per_node: int
    training_gpus: int
    params_total: int
    params_active: int
    layout: Layout
    memory: Memory
    stage: int
    capacity_gb: float
    host: HostMemory
    host_node_gb: float  # the node's host memory (--host-mem)
    fits: bool
    ranked: list[tuple[Layout, float]] = field(default_factory=list)  # layouts that fit, best first, with GB
    rollout: RolloutPlan | None = None
    params_layers: int = 0  # the model's decoder layers (for the stage split)
    micro_batch_positions: int = 0  # of the largest micro-batch (`micro_batch_positions`)
    token_budget: int | None = None  # train.max_tokens_per_microbatch: micro-batches sized by it
    micro_batch: str = ""  # `micro_batch_text`
    moe: dict | None = None  # how the MoE layers run (`moe_execution`); None for a dense model

    @property
    def gpu_fits(self) -> bool:
        return self.memory.total <= self.capacity_gb * GB

    @property
    def host_capacity_gb(self) -> float:
        return round(self.host_node_gb * HOST_USABLE_FRACTION, 1)

    @property
    def host_fits(self) -> bool:
        return self.host.total <= self.host_capacity_gb * GB

    def to_json(self) -> dict:
        return {
            "gpu": self.gpu.name, "nodes": self.nodes, "training_gpus": self.training_gpus,
            "params_total": self.params_total, "params_active": self.params_active,
            "layout": asdict(self.layout), "stage_layers": self.layout.stage_layers(self.params_layers),
            "expert_a2a_crosses_nodes": self.layout.expert_a2a_crosses_nodes(self.gpus_per_node),
            "per_gpu_memory_gb": round(self.memory.total / GB, 3),
            "per_gpu_memory_breakdown_gb": self.memory.gb(), "most_loaded_stage": self.stage,
            "usable_gb": self.capacity_gb, "host_memory_per_node_gb": self.host.gb(),
            "host_usable_gb": self.host_capacity_gb, "fits": self.fits, "gpu_fits": self.gpu_fits,
            "host_fits": self.host_fits,
            "ranked_layouts": [{**asdict(lay), "per_gpu_memory_gb": gb,
                                "expert_a2a_crosses_nodes": lay.expert_a2a_crosses_nodes(self.gpus_per_node)}
                               for lay, gb in self.ranked],
            "rollout": asdict(self.rollout) if self.rollout else None,
            "micro_batch_positions": self.micro_batch_positions,
            "micro_batch_sized_by": "max_tokens_per_microbatch" if self.token_budget is not None
            else "micro_batch_size",
            "moe": self.moe,
        }


def plan(cfg, *, nodes: int | None = None, gpu: str | None = None, host_mem_gb: float | None = None,
         top: int = 10) -> Plan:
    """The config's own layout on `nodes` nodes of `gpu` (default: cluster.nodes, cluster.gpu) with `host_mem_gb`
    of host memory per node (default: the GPU kind's standard node), and the ranked layouts that fit (GPU and host
    memory, and room for colocated engines) and split each minibatch evenly over DP (the best `top`; 0 skips the
    ranking); what the trainer would refuse on these nodes (`Config.check_world_size`) is an error. Each layout's
    per-GPU memory counts the weight sync's buffers (`train.weight_sync.weight_sync_peak_bytes` at
    rollout.sync_bucket_bytes, float32 export, the engine's copy of a bucket on rank 0: the most any rank holds).
    Training takes nodes - cluster.rollout_nodes nodes; with rollout_nodes = 0 the SGLang engines are colocated:
    they release their memory while the trainer trains (rollout.sglang.release_memory), take it back for the weight sync
    and generate beside the trainer's weights, gradients and GPU optimizer states."""
    c = cfg.cluster
    nodes = nodes if nodes is not None else c.nodes
    g = GPUS[check_choice("gpu", gpu or c.gpu, GPUS)]
    check_int("top", top, lo=0)
    host_gb = check_number("host-mem", g.host_memory_gb if host_mem_gb is None else host_mem_gb, lo=0,
                           lo_open=True, finite=True)  # GB per node
    check_int("nodes", nodes)
    if nodes <= c.rollout_nodes:
        raise ValueError(f"nodes: {nodes} leaves no training node beside cluster.rollout_nodes = {c.rollout_nodes}")
    on = replace(c, nodes=nodes)
    world = on.training_gpus
    cfg.check_world_size(world, on.describe_training_gpus())  # what the trainer would refuse on these nodes
    counts = count_parameters(cfg.model)
    seq = sequence_length(cfg)
    layout = layout_of(cfg.model, cfg.parallel, world, seq)
    sync_peaks = {}

    def with_sync(lay: Layout) -> tuple[Memory, int]:
        """`training_memory` with the weight sync's buffers (they depend on PP, its stages' layers and EP only)."""
        mem, stage = training_memory(cfg, lay)
        key = (lay.pp, lay.first_stage_layers, lay.last_stage_layers, lay.ep)
        if key not in sync_peaks:
            sync_peaks[key] = weight_sync_peak_bytes(cfg.model, lay.parallel,
                                                     bucket_bytes=cfg.rollout.sync_bucket_bytes,
                                                     rollout=cfg.precision.rollout,
                                                     holds_update=cfg.rollout.sglang.weight_sync == "tensor")
        mem.weight_sync = float(sync_peaks[key])
        return mem, stage

    mem, stage = with_sync(layout)
    usable = g.memory_gb * USABLE_FRACTION
    ranked = []
    rows = cfg.train.prompts_per_step * cfg.rollout.n // cfg.train.minibatches  # sequences per minibatch
    rollout_gpus = (c.rollout_nodes or nodes - c.rollout_nodes) * c.gpus_per_node
    if rollout_gpus % c.rollout_tp:
        raise ValueError(f"cluster.rollout_tp: {c.rollout_tp} must divide the {rollout_gpus} rollout GPUs")
    engines = rollout_gpus // c.rollout_tp
    spec = engine_spec(cfg.rollout.engine)
    if spec.check_tp is not None:  # e.g. SGLang shards the attention heads over its TP, FP8 blocks whole per GPU
        spec.check_tp(cfg, c.rollout_tp, "cluster.rollout_tp")
    for lay in candidate_layouts(cfg.model, world, c.gpus_per_node, seq) if top > 0 else ():
        if rows < lay.dp or (rows % lay.dp and cfg.train.max_tokens_per_microbatch is None):
            continue  # the minibatch does not split over this DP: the trainer would refuse it
        m, _ = with_sync(lay)
        if m.total > usable * GB or host_memory(cfg, lay, c.gpus_per_node, colocated=not c.rollout_nodes).total \
                > host_gb * HOST_USABLE_FRACTION * GB:
            continue
        if not c.rollout_nodes and not rollout_memory(cfg, g, engines=engines, beside=m.beside_engines).fits:
            continue  # colocated engines would have no room beside this layout's states and the sync's buffers
        ranked.append((lay, round(m.total / GB, 3)))
    ranked.sort(key=lambda x: _rank_key(x[0], x[1], usable, c.gpus_per_node, seq))
    # colocated engines take their memory back for the weight sync (SGLang's update_weights resumes it), so they
    # share the GPU with the trainer's states and the sync's buffers
    beside = 0.0 if c.rollout_nodes else mem.beside_engines
    rollout = rollout_memory(cfg, g, engines=engines, beside=beside)
    rollout.environment = spec.environment(cfg) if spec.environment is not None else "the trainer's environment"
    host = host_memory(cfg, layout, c.gpus_per_node, colocated=not c.rollout_nodes)
    p = Plan(g, nodes, c.gpus_per_node, world, counts.total, counts.active, layout, mem, stage, round(usable, 3),
             host, host_gb, fits=False, ranked=ranked[:top], rollout=rollout, params_layers=cfg.model.num_layers,
             micro_batch_positions=micro_batch_positions(cfg), token_budget=cfg.train.max_tokens_per_microbatch,
             micro_batch=micro_batch_text(cfg), moe=moe_execution(cfg))
    p.fits = p.gpu_fits and p.host_fits and rollout.fits
    return p


def moe_execution(cfg) -> dict | None:
    """How the trainer's MoE layers run (model.moe_token_dispatcher_type, moe_enable_deepep, moe_grouped_gemm,
    rollout.routed_experts with train.recompute); None for a dense model."""
    m = cfg.model
    if not m.is_moe:
        return None
    return {"token_dispatcher": m.moe_token_dispatcher_type, "deepep": m.moe_enable_deepep,
            "grouped_gemm": m.moe_grouped_gemm, "routed_expert_replay": cfg.rollout.routed_experts,
            "recompute": cfg.train.recompute}


def _moe_text(moe: dict) -> str:
    """'alltoall dispatcher, grouped GEMM, routed-expert replay (R3) under full recompute'."""
    parts = [f"{moe['token_dispatcher']} dispatcher" + (" (DeepEP)" if moe["deepep"] else ""),
             "grouped GEMM" if moe["grouped_gemm"] else "one GEMM per local expert"]
    if moe["routed_expert_replay"]:
        parts.append("routed-expert replay (R3)" + (f" under {moe['recompute']} recompute"
                                                    if moe["recompute"] != "none" else ""))
    return ", ".join(parts)


def _stages_text(n: list[int]) -> str:
    """'3 + 14 x 4 + 2 layers' for an uneven pipeline; '4 x 16 layers' for an even one."""
    if len(set(n)) == 1:
        return f"{len(n)} x {n[0]} layers"
    middle = n[1:-1]
    parts = [str(n[0])] + ([f"{len(middle)} x {middle[0]}"] if middle else []) + [str(n[-1])]
    return " + ".join(parts) + " layers"


def format_plan(p: Plan) -> str:
    gb = p.memory.gb()
    lay = p.layout
    a2a = "crosses nodes" if lay.expert_a2a_crosses_nodes(p.gpus_per_node) else "inside each node"
    lines = [
        f"parameters: {p.params_total / 1e9:,.2f}B total, {p.params_active / 1e9:,.2f}B active per token",
        f"training: {p.training_gpus} x {p.gpu.name} on {p.nodes} node(s), layout {lay.label()}",
        f"pipeline stages: {_stages_text(lay.stage_layers(p.params_layers))} (embedding on the first, output "
        "layer and logits on the last)" if lay.pp > 1 else "pipeline stages: 1",
    ]
    if p.micro_batch:
        lines.append(p.micro_batch)
    if p.moe:
        lines.append(f"MoE layers: {_moe_text(p.moe)}")
    if lay.ep > 1:
        lines.append(f"expert all-to-all: EP{lay.ep} x ETP{lay.etp} = {lay.ep * lay.etp} GPUs, {a2a} "
                     f"({p.gpus_per_node} GPUs per node)")
    lines.append(f"per-GPU memory (stage {p.stage}, GB): " + ", ".join(f"{k} {v:,.2f}" for k, v in gb.items())
                 + " (the weight sync's buffers come after the step: the total counts the larger of them and "
                 "activations + logits + pdm)")
    if p.gpu_fits:
        lines.append(f"fits: {gb['total']:,.2f} GB of {p.capacity_gb:,.2f} usable")
    else:
        lines.append(f"does not fit: needs {gb['total']:,.2f} GB, has {p.capacity_gb:,.2f} "
                     f"({USABLE_FRACTION:.0%} of {p.gpu.memory_gb} GB)")
    h = p.host.gb()
    verdict = "fits" if p.host_fits else "does not fit"
    lines.append("host memory per training node (GB): " + ", ".join(f"{k} {v:,.1f}" for k, v in h.items())
                 + f": {verdict} in {p.host_capacity_gb:,.1f} usable ({HOST_USABLE_FRACTION:.0%} of "
                 f"{p.host_node_gb:,.0f})")
    r = p.rollout
    if r:
        verdict = "fits" if r.fits else f"does not fit: {r.problem}"
        dp = f", DP-attention {r.attention_dp}" if r.attention_dp > 1 else ""
        lines.append(f"rollout: {r.engines} SGLang engine(s) x {r.gpus_per_engine} GPU(s){dp} at mem_fraction_static "
                     f"{r.mem_fraction_static:.2f}: weights "
                     f"{r.weights_gb_per_gpu:,.2f} GB/GPU, KV cache {r.kv_bytes_per_token / 1024:,.1f} KiB/token/GPU, "
                     f"{r.kv_tokens_per_engine:,} tokens ({r.sequences_per_engine:,} full-length sequences at once, "
                     f"a step needs {r.needed_sequences_per_engine:,} per engine): {verdict}; engines run in "
                     f"{r.environment}")
    if p.ranked:
        lines.append(f"layouts that fit, best first (under {TIGHT_FRACTION:.0%} of usable memory first; then expert "
                     "all-to-all inside a node; fewest pipeline / context stages; smallest TP; fewest EP peers):")
        lines += [f"  {x.label():<36} {gb_:>9,.2f} GB"
                  + ("  expert all-to-all crosses nodes" if x.expert_a2a_crosses_nodes(p.gpus_per_node) else "")
                  for x, gb_ in p.ranked]
    else:
        lines.append("no layout fits on these nodes")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# uneven pipeline stages chosen for the user


def _num_layers(d: dict) -> int | None:
    """model.num_layers of a raw config dict: the model section's, else the checkpoint's config.json (train.init
    hf), else None."""
    model, train = d.get("model") or {}, d.get("train") or {}
    if isinstance(model, dict) and "num_layers" in model:
        return model["num_layers"]
    if train.get("init") == "hf" and isinstance(train.get("init_path"), str):
        import json
        from pathlib import Path

        path = Path(train["init_path"]) / "config.json"
        if path.is_file():
            return json.loads(path.read_text()).get("num_hidden_layers")
    return None


def fill_stage_layers(d: dict) -> str | None:
    """When a raw config dict asks for parallel.pipeline stages that do not divide model.num_layers and gives
    neither parallel.first_stage_layers nor last_stage_layers, set them to `auto_stage_layers`' split (in place) and
    return a line saying so; else None (the config then loads or fails as it is)."""
    par = d.get("parallel") or {}
    layers = _num_layers(d)
    pp = par.get("pipeline", 1) if isinstance(par, dict) else 1
    if (not is_int(layers) or not is_int(pp) or pp < 2 or layers < 1
            or par.get("first_stage_layers") or par.get("last_stage_layers") or layers % pp == 0):
        return None
    first, last = auto_stage_layers(layers, pp)
    d["parallel"] = {**par, "first_stage_layers": first, "last_stage_layers": last}
    n = pipeline_layer_counts(layers, ParallelConfig(pipeline=pp, first_stage_layers=first, last_stage_layers=last))
    return (f"parallel.pipeline = {pp} does not divide model.num_layers = {layers}: using uneven stages "
            f"parallel.first_stage_layers={first} parallel.last_stage_layers={last} ({_stages_text(n)})")


def load_plan_config(path, overrides=(), *, notes: list | None = None):
    """`load_config` for `plan` and `submit`, with uneven pipeline stages filled in (`fill_stage_layers`), whose
    note on the chosen split is appended to `notes` (before the config is checked, so it is there on an error)."""
    from megatron_pdm.train.config import config_from_dict, read_config_dict

    d = read_config_dict(path, list(overrides))
    note = fill_stage_layers(d)
    if note and notes is not None:
        notes.append(note)
    return config_from_dict(d)
