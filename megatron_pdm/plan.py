"""`megatron-pdm plan`: does a config fit, and with which parallelism, before anything is launched.

Three pure pieces, each on a `Config` (no process group, no GPU):

- `count_parameters(model)`: exact parameter counts, total and active per token, module by module as megatron-core
  builds the GPTModel (tests compare them with the count of a built model and with published totals).
- `training_memory(cfg, layout, gpu)`: per-GPU bytes of the most loaded pipeline stage, by item (weights, gradients,
  optimizer states, activations, the TP-sharded logits, what PDM adds on top of them).
- `rollout_memory(cfg, gpu)`: an SGLang engine's weights and the KV-cache tokens that fit beside them.

`plan(cfg, nodes, gpu)` ranks every valid TP / PP / EP / CP / DP factorisation. Units: 1 GB = 2**30 bytes, as
`nvidia-smi` and `torch.cuda.memory_allocated` count. The activation model is for the GPU path (Transformer
Engine, flash attention: no [S, S] scores are stored) and counts the tensors each sub-layer saves for backward.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, replace

from megatron_pdm.models import ModelConfig

GB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float  # what the device reports, GiB


GPUS = {
    "h100": GPU("H100 SXM 80GB", 79.6),  # 81,559 MiB
    "h200": GPU("H200 SXM 141GB", 140.4),  # 143,771 MiB
    "b200": GPU("B200 180GB", 178.4),  # 182,681 MiB
}
# Of a GPU's memory, the part a plan may fill: the rest is the CUDA context, NCCL buffers and allocator
# fragmentation (megatron runs typically see 3-8 GB of these on an 80 GB device).
USABLE_FRACTION = 0.9
# SGLang's default --mem-fraction-static on large GPUs: weights plus KV pool; the rest is activations and graphs.
SGLANG_MEM_FRACTION_STATIC = 0.85

# bytes per parameter by training precision: the weights megatron computes with (fp8: the bf16 weights plus the
# fp8 copy Transformer Engine caches for forward and backward)
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 3}
GRAD_BYTES = 4  # the DDP gradient buffer is fp32 (grad_reduce_in_fp32, as the trainer sets it)
ADAM_BYTES = {"fp32": 8, "bf16": 12, "fp16": 12, "fp8": 12}  # (fp32 main params +) exp_avg + exp_avg_sq
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


def _attention_params(m: ModelConfig) -> int:
    """One layer's attention with its input norm: GQA with QK-norm (Qwen3) or multi-latent attention (DeepSeek-V3)."""
    h, n, d = m.hidden_size, m.num_attention_heads, m.head_dim
    if not m.multi_latent_attention:
        return h + h * (n * d + 2 * m.num_query_groups * d) + 2 * d + n * d * h
    r, v = m.qk_rope_head_dim, m.v_head_dim
    q = h * n * (d + r) if not m.q_lora_rank else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * (d + r)
    kv = h * (m.kv_lora_rank + r) + m.kv_lora_rank + m.kv_lora_rank * n * (d + v)
    return h + q + kv + n * v * h


def _swiglu(h: int, f: int) -> int:
    return h * 2 * f + f * h


def _replicated_per_layer(m: ModelConfig) -> int:
    """Parameters of a layer that every TP rank holds whole: its two norms and the norms inside attention
    (Qwen3's QK-norm, MLA's query and KV latent norms)."""
    inner = m.q_lora_rank + m.kv_lora_rank if m.multi_latent_attention else 2 * m.head_dim
    return 2 * m.hidden_size + inner


def is_moe_layer(m: ModelConfig, i: int) -> bool:
    return m.is_moe and i >= m.moe_first_k_dense


def count_parameters(m: ModelConfig) -> ParameterCount:
    """Exact parameter counts of megatron-core's GPTModel for `m` (the layer norms fused into TE linears count the
    same). Router expert biases are buffers in megatron-core, not parameters, and are not counted."""
    h, L = m.hidden_size, m.num_layers
    moe = [is_moe_layer(m, i) for i in range(L)]
    dense_ffn = m.ffn_hidden_size
    shared = _swiglu(h, m.moe_shared_expert_ffn_hidden_size) if m.moe_shared_expert_ffn_hidden_size else 0
    return ParameterCount(
        embedding=m.vocab_size * h,
        output=0 if m.tie_word_embeddings else m.vocab_size * h,
        final_norm=h,
        attention=[_attention_params(m)] * L,
        dense_mlp=[h + (0 if x else _swiglu(h, dense_ffn)) for x in moe],
        router=[m.num_experts * h if x else 0 for x in moe],
        shared_expert=[shared if x else 0 for x in moe],
        routed_expert=_swiglu(h, m.moe_ffn_hidden_size) if m.is_moe else 0,
        experts_per_layer=[m.num_experts if x else 0 for x in moe],
        moe_topk=m.moe_router_topk if m.is_moe else 0,
    )


# --------------------------------------------------------------------------------------------------------------
# training memory


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    ep: int
    cp: int
    dp: int
    etp: int  # expert tensor parallelism

    @property
    def edp(self) -> int:
        """Expert data parallelism: megatron folds the dense TP x CP x DP ranks of a stage into ETP x EP x EDP."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    def label(self) -> str:
        s = f"TP{self.tp} PP{self.pp} CP{self.cp} DP{self.dp}"
        return s + (f" EP{self.ep} ETP{self.etp}" if self.ep > 1 or self.etp != self.tp else "")


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
    """Bytes per GPU, by item; `total` is their sum."""

    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    pdm: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.pdm

    def gb(self) -> dict:
        return {**{k: round(v / GB, 3) for k, v in asdict(self).items()}, "total": round(self.total / GB, 3)}


def sequence_length(cfg) -> int:
    """Tokens of one training sequence at most: the longest prompt plus the longest response."""
    return cfg.data.max_prompt_length + cfg.rollout.max_new_tokens


def pdm_bytes(tokens: int, vocab_shard: int, top_k: int) -> float:
    """What the masks add beside the logits, per micro-batch of `tokens` response tokens: the rollout's top-K ids
    (int64) and log-probs (fp32), the sampled token's id and log-prob, the packed [T, K+4] fp32 partial sums, about
    eight fp32 per-token statistics (log Z, log pi(k), entropy, D, Ddot, masks, ratio), and the two fp32 work
    buffers of one sub-chunk (vocab_parallel.core.SUB_CHUNK_BYTES on a GPU)."""
    from megatron_pdm.vocab_parallel.core import SUB_CHUNK_BYTES

    per_token = top_k * (8 + 4) + (8 + 4) + (top_k + 4) * 4 + 8 * 4
    return tokens * per_token + 2 * min(SUB_CHUNK_BYTES["cuda"], tokens * vocab_shard * 4)


def training_memory(cfg, layout: Layout) -> tuple[Memory, int]:
    """Per-GPU bytes on the most loaded pipeline stage under `layout`, and that stage's index.

    weights + grads: the stage's dense parameters / TP (norms and routers replicated) and its routed experts
    / (EP x ETP); optimizer: Adam states (with fp32 main parameters unless training in fp32), sharded over DP x CP
    (dense) and expert-DP (experts) when optim.distributed_optimizer is set; activations: 1F1B keeps (PP - stage)
    micro-batches in flight, each saving its layers' activations of micro_batch_size x seq / CP tokens, / TP under
    sequence parallelism (with full recompute only each layer's input, plus one layer recomputed at a time);
    logits (last stage): the bf16 [tokens, V/TP] shard and its gradient; pdm: `pdm_bytes`."""
    m, p = cfg.model, cfg.precision.train
    counts = count_parameters(m)
    L = m.num_layers
    per_stage = L // layout.pp
    tokens = cfg.train.micro_batch_size * sequence_length(cfg) // layout.cp
    shard_tokens = tokens / layout.tp  # sequence parallelism
    vocab_shard = m.vocab_size // layout.tp
    dp_dense = layout.dp * layout.cp if cfg.optim.distributed_optimizer else 1
    dp_expert = layout.edp if cfg.optim.distributed_optimizer else 1
    best, best_stage = None, 0
    for stage in range(layout.pp):
        layers = range(stage * per_stage, (stage + 1) * per_stage)
        replicated = sum(_replicated_per_layer(m) + counts.router[i] for i in layers)
        dense = sum(counts.layer(i, experts=False) for i in layers) - replicated
        if stage == 0:
            dense += counts.embedding
        if stage == layout.pp - 1:
            dense += counts.output + (counts.embedding if counts.output == 0 and layout.pp > 1 else 0)
            replicated += counts.final_norm
        dense_local = dense / layout.tp + replicated
        experts = sum(counts.experts_per_layer[i] for i in layers)
        expert_local = experts * counts.routed_expert / (layout.ep * layout.etp)
        mem = Memory()
        mem.weights = (dense_local + expert_local) * WEIGHT_BYTES[p]
        mem.grads = (dense_local + expert_local) * GRAD_BYTES
        mem.optimizer = ADAM_BYTES[p] * (dense_local / dp_dense + expert_local / dp_expert)
        in_flight = layout.pp - stage
        act = ACT_BYTES[p]
        per_layer = [_activation_elements_per_token(m, is_moe_layer(m, i)) * shard_tokens * act for i in layers]
        if cfg.train.recompute == "full":
            mem.activations = in_flight * per_stage * m.hidden_size * shard_tokens * act + max(per_layer)
        else:
            mem.activations = in_flight * sum(per_layer)
        if stage == layout.pp - 1:
            mem.logits = 2 * tokens * vocab_shard * 2
            mem.pdm = pdm_bytes(tokens, vocab_shard, cfg.objective.top_k)
        if best is None or mem.total > best.total:
            best, best_stage = mem, stage
    return best, best_stage


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


@dataclass
class RolloutPlan:
    engines: int
    gpus_per_engine: int
    mem_fraction_static: float  # of each GPU, for the engine's weights and KV pool (SGLang's flag)
    weights_gb_per_gpu: float
    kv_bytes_per_token: float
    kv_tokens_per_engine: int
    sequences_per_engine: int  # that fit at full length (prompt + response)
    needed_sequences_per_engine: int  # one step's rollouts / engines
    fits: bool


def rollout_memory(cfg, gpu: GPU, *, engines: int, beside: float = 0.0) -> RolloutPlan:
    """SGLang engines of cluster.rollout_tp GPUs each: weights / TP per GPU, and the KV pool beside them within
    mem_fraction_static of the GPU. `beside`: bytes per GPU the trainer keeps while the engines generate
    (colocated engines: its weights, gradients and optimizer states; the engines release theirs while it trains),
    which lowers mem_fraction_static from SGLang's default to what is left of the usable memory."""
    m, tp = cfg.model, cfg.cluster.rollout_tp
    weights = rollout_weight_bytes(m, cfg.precision.rollout) / tp
    per_token = kv_bytes_per_token(m, cfg.precision.kv_cache, tp)
    capacity = gpu.memory_gb * GB
    fraction = SGLANG_MEM_FRACTION_STATIC
    if beside:
        fraction = min(fraction, math.floor(100 * (capacity * USABLE_FRACTION - beside) / capacity) / 100)
    pool = capacity * fraction - weights
    kv_tokens = max(0, int(pool / per_token))
    seq = sequence_length(cfg)
    needed = math.ceil(cfg.train.prompts_per_step * cfg.rollout.n / engines)
    fits_seqs = kv_tokens // seq
    return RolloutPlan(engines, tp, fraction, round(weights / GB, 3), per_token, kv_tokens, fits_seqs, needed,
                       fits=pool > 0 and fits_seqs >= 1)


# --------------------------------------------------------------------------------------------------------------
# layouts


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_of(cfg, world: int) -> Layout:
    """The layout a config asks for on `world` training GPUs (DP is what is left)."""
    p = cfg.parallel
    model_parallel = p.tensor * p.pipeline * p.context
    if world % model_parallel:
        raise ValueError(f"parallel: tensor x pipeline x context = {model_parallel} must divide the {world} training "
                         "GPUs")
    layout = Layout(p.tensor, p.pipeline, p.expert, p.context, world // model_parallel, p.expert_tensor or p.tensor)
    problem = layout_problem(cfg.model, layout, sequence_length(cfg))
    if problem:
        raise ValueError(f"parallel: {layout.label()} is not valid for this model: {problem}")
    return layout


def layout_problem(m: ModelConfig, lay: Layout, seq: int) -> str | None:
    """Why megatron-core would reject `lay` for `m`, or None."""
    if m.vocab_size % lay.tp:
        return f"vocab_size {m.vocab_size} is not divisible by TP {lay.tp}"
    if m.num_query_groups % lay.tp or m.num_attention_heads % lay.tp:
        return f"{m.num_query_groups} query groups / {m.num_attention_heads} heads are not divisible by TP {lay.tp}"
    if m.num_layers % lay.pp:
        return f"{m.num_layers} layers are not divisible by PP {lay.pp}"
    if seq % (2 * lay.cp) and lay.cp > 1:
        return f"sequence length {seq} is not divisible by 2 x CP {2 * lay.cp}"
    if not m.is_moe:
        return None if lay.ep == 1 and lay.etp == lay.tp else "EP / ETP need an MoE model"
    if m.num_experts % lay.ep:
        return f"{m.num_experts} experts are not divisible by EP {lay.ep}"
    if (lay.tp * lay.cp * lay.dp) % (lay.ep * lay.etp):
        return f"EP {lay.ep} x ETP {lay.etp} must divide TP x CP x DP = {lay.tp * lay.cp * lay.dp}"
    if m.moe_ffn_hidden_size % lay.etp:
        return f"moe_ffn_hidden_size {m.moe_ffn_hidden_size} is not divisible by ETP {lay.etp}"
    return None


def candidate_layouts(m: ModelConfig, world: int, gpus_per_node: int, seq: int) -> list[Layout]:
    """Every valid factorisation: TP and ETP within a node (their collectives are per layer), CP up to 8."""
    out = []
    for tp, pp, cp in itertools.product(_divisors(gpus_per_node), _divisors(m.num_layers), (1, 2, 4, 8)):
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        eps = _divisors(m.num_experts) if m.is_moe else [1]
        etps = sorted({1, tp}) if m.is_moe else [tp]
        for ep, etp in itertools.product(eps, etps):
            lay = Layout(tp, pp, ep, cp, dp, etp)
            if layout_problem(m, lay, seq) is None:
                out.append(lay)
    return out


TIGHT_FRACTION = 0.85  # a layout above this share of the usable memory has no room for a longer batch or a spike


def _rank_key(lay: Layout, mem_gb: float, usable_gb: float):
    """Layouts with headroom first; then the fewest pipeline stages and context ranks (bubbles, ring attention),
    the smallest TP (per-layer all-reduces), the fewest expert-parallel peers (all-to-all), and less memory."""
    return (mem_gb > TIGHT_FRACTION * usable_gb, lay.pp * lay.cp, lay.pp, lay.tp, lay.ep * lay.etp, mem_gb)


@dataclass
class Plan:
    gpu: GPU
    nodes: int
    training_gpus: int
    params_total: int
    params_active: int
    layout: Layout
    memory: Memory
    stage: int
    capacity_gb: float
    fits: bool
    ranked: list[tuple[Layout, float]] = field(default_factory=list)  # layouts that fit, best first, with GB
    rollout: RolloutPlan | None = None

    def to_json(self) -> dict:
        return {
            "gpu": self.gpu.name, "nodes": self.nodes, "training_gpus": self.training_gpus,
            "params_total": self.params_total, "params_active": self.params_active,
            "layout": asdict(self.layout), "per_gpu_memory_gb": round(self.memory.total / GB, 3),
            "per_gpu_memory_breakdown_gb": self.memory.gb(), "most_loaded_stage": self.stage,
            "usable_gb": self.capacity_gb, "fits": self.fits,
            "ranked_layouts": [{**asdict(lay), "per_gpu_memory_gb": gb} for lay, gb in self.ranked],
            "rollout": asdict(self.rollout) if self.rollout else None,
        }


def plan(cfg, *, nodes: int | None = None, gpu: str | None = None, top: int = 10) -> Plan:
    """The config's own layout on `nodes` nodes of `gpu` (default: cluster.nodes, cluster.gpu), and the ranked
    layouts that fit and split each minibatch evenly over DP; what the trainer would refuse on these nodes
    (`Config.check_world_size`) is an error. Training takes nodes - cluster.rollout_nodes nodes; with
    rollout_nodes = 0 the SGLang engines are colocated: they release their memory while the trainer trains
    (rollout.release_memory), and generate beside the trainer's weights, gradients and optimizer states."""
    c = cfg.cluster
    nodes = nodes if nodes is not None else c.nodes
    gpu_name = gpu or c.gpu
    if gpu_name not in GPUS:
        raise ValueError(f"gpu: {gpu_name!r} is not one of {', '.join(GPUS)}")
    g = GPUS[gpu_name]
    if nodes <= c.rollout_nodes:
        raise ValueError(f"nodes: {nodes} leaves no training node beside cluster.rollout_nodes = {c.rollout_nodes}")
    on = replace(c, nodes=nodes)
    world = on.training_gpus
    cfg.check_world_size(world, on.describe_training_gpus())  # what the trainer would refuse on these nodes
    counts = count_parameters(cfg.model)
    layout = layout_of(cfg, world)
    mem, stage = training_memory(cfg, layout)
    usable = g.memory_gb * USABLE_FRACTION
    seq = sequence_length(cfg)
    ranked = []
    rows = cfg.train.prompts_per_step * cfg.rollout.n // cfg.train.minibatches  # sequences per minibatch
    for lay in candidate_layouts(cfg.model, world, c.gpus_per_node, seq):
        if rows < lay.dp or (rows % lay.dp and cfg.train.max_tokens_per_microbatch is None):
            continue  # the minibatch does not split over this DP: the trainer would refuse it
        m, _ = training_memory(cfg, lay)
        if m.total <= usable * GB:
            ranked.append((lay, round(m.total / GB, 3)))
    ranked.sort(key=lambda x: _rank_key(x[0], x[1], usable))
    rollout_gpus = (c.rollout_nodes or nodes - c.rollout_nodes) * c.gpus_per_node
    if rollout_gpus % c.rollout_tp:
        raise ValueError(f"cluster.rollout_tp: {c.rollout_tp} must divide the {rollout_gpus} rollout GPUs")
    if cfg.precision.rollout == "fp8" and cfg.rollout.engine == "sglang":  # engines start from block-FP8 weights
        from megatron_pdm.precision import check_fp8_block_shapes

        check_fp8_block_shapes(cfg.model, c.rollout_tp, field="cluster.rollout_tp")
    beside = 0.0 if c.rollout_nodes else mem.weights + mem.grads + mem.optimizer
    rollout = rollout_memory(cfg, g, engines=rollout_gpus // c.rollout_tp, beside=beside)
    return Plan(g, nodes, world, counts.total, counts.active, layout, mem, stage, round(usable, 3),
                fits=mem.total <= usable * GB and rollout.fits, ranked=ranked[:top], rollout=rollout)


def format_plan(p: Plan) -> str:
    gb = p.memory.gb()
    lines = [
        f"parameters: {p.params_total / 1e9:,.2f}B total, {p.params_active / 1e9:,.2f}B active per token",
        f"training: {p.training_gpus} x {p.gpu.name} on {p.nodes} node(s), layout {p.layout.label()}",
        f"per-GPU memory (stage {p.stage}, GB): " + ", ".join(f"{k} {v:,.2f}" for k, v in gb.items()),
    ]
    if p.memory.total <= p.capacity_gb * GB:
        lines.append(f"fits: {gb['total']:,.2f} GB of {p.capacity_gb:,.2f} usable")
    else:
        lines.append(f"does not fit: needs {gb['total']:,.2f} GB, has {p.capacity_gb:,.2f} "
                     f"({USABLE_FRACTION:.0%} of {p.gpu.memory_gb} GB)")
    r = p.rollout
    if r:
        verdict = "fits" if r.fits else "does not fit"
        lines.append(f"rollout: {r.engines} SGLang engine(s) x {r.gpus_per_engine} GPU(s) at mem_fraction_static "
                     f"{r.mem_fraction_static:.2f}: weights "
                     f"{r.weights_gb_per_gpu:,.2f} GB/GPU, KV cache {r.kv_bytes_per_token / 1024:,.1f} KiB/token/GPU, "
                     f"{r.kv_tokens_per_engine:,} tokens ({r.sequences_per_engine:,} full-length sequences at once, "
                     f"a step needs {r.needed_sequences_per_engine:,} per engine): {verdict}")
    if p.ranked:
        lines.append(f"layouts that fit, best first (under {TIGHT_FRACTION:.0%} of usable memory first; then fewest "
                     "pipeline / context stages, smallest TP, fewest EP peers):")
        lines += [f"  {lay.label():<32} {gb_:>9,.2f} GB" for lay, gb_ in p.ranked]
    else:
        lines.append("no layout fits on these nodes")
    return "\n".join(lines)
