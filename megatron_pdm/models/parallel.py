"""The parallel layout and its process groups: `ParallelConfig` (the sizes) with the pure layout functions, and the
one `ParallelContext` built from it at start-up and passed down.

`initialize_parallel` is the only place that reads megatron's `parallel_state` (its globals): it builds megatron's
groups there, and everything the rest of the code needs from them (groups, ranks, which chunk holds the embedding,
each rank's role in a weight export, the replicas that share data) is read once into the context. `Learner`,
`Trainer`, the HF mapping, the weight sync and the batch fan-out take the context; megatron's own modules take its
`ProcessGroupCollection` (`ParallelContext.groups`). `ParallelContext.close()` tears it all down.

Ranks in a world of W = TP x CP x PP x DP processes, as megatron orders them (tp fastest, then cp, ep, dp, pp);
expert layers regroup the same ranks as ETP x EP x EDP x PP:

    replica (same data):   TP x CP x PP ranks, one DP rank's        `replicas`, `replica_group`
    a sequence's tokens:   CP ranks (with TP, the TP x CP group)    `cp_group`, `groups.tp_cp`
    the vocabulary:        TP ranks                                 `tp_group`
    the loss and gradients summed over DP x CP                     `dp_cp_group`
    a weight export's gathers: TP (dense, DP = CP = 0) and ETP then EP (experts, EDP = 0), onto the stage's
    sender, the first rank of its stage                             `roles`, `pipeline_ranks`
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_pdm._validate import check_int
from megatron_pdm.compat import apply_cpu_patches


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes; data parallelism is what the world size leaves. expert_tensor 0 means megatron's
    default (the tensor size). context: each sequence split over this many ranks (context parallelism, megatron's
    load-balanced layout of 2 x context chunks). first_stage_layers / last_stage_layers: the decoder layers of the
    first / last pipeline stage (0: an even share), megatron's num_layers_in_first/last_pipeline_stage; the middle
    stages split the rest evenly. They make 61-layer models (DeepSeek-V3, Kimi-K2) pipeline, and let the stages
    holding the embedding and the [T, V/tp] logits carry fewer layers. virtual: model chunks per pipeline stage
    (megatron's interleaved schedule, virtual_pipeline_model_parallel_size): each stage's layers split into this many
    equal chunks, chunk v of every stage before chunk v + 1 of any (`pipeline_layer_range`); the bubble shrinks from
    (PP - 1) / M to (PP - 1) / (virtual x M) of a step for M micro-batches, for virtual x more point-to-point
    messages and, on the first stage, 1 + (PP - 1) / (PP x virtual) x the activations in flight."""

    tensor: int = 1  # TP: ranks each layer's weights are split over (megatron's tensor_model_parallel_size)
    pipeline: int = 1  # PP: pipeline stages the decoder layers are split over
    expert: int = 1  # EP: ranks the routed experts are split over (MoE only)
    context: int = 1  # CP: ranks each sequence is split over (2 x CP load-balanced chunks)
    expert_tensor: int = 0  # ETP: ranks each expert's weights are split over (0: TP; 1 on CPU with EP > 1)
    first_stage_layers: int = 0  # decoder layers of the first pipeline stage (0: an even share)
    last_stage_layers: int = 0  # decoder layers of the last pipeline stage (0: an even share)
    virtual: int = 1  # model chunks per pipeline stage (interleaved schedule; 1: none, > 1 needs pipeline >= 3)

    def __post_init__(self):
        for name in ("tensor", "pipeline", "expert", "context", "virtual"):
            check_int(f"parallel.{name}", getattr(self, name))
        for name in ("expert_tensor", "first_stage_layers", "last_stage_layers"):
            check_int(f"parallel.{name}", getattr(self, name), lo=0)
        if self.pipeline == 1 and (self.first_stage_layers or self.last_stage_layers):
            raise ValueError("parallel.first_stage_layers / last_stage_layers: set only with parallel.pipeline > 1, "
                             f"got pipeline = 1 with {self.first_stage_layers} / {self.last_stage_layers}")
        if self.virtual > 1 and self.pipeline < 3:
            # at PP 2 a stage's previous and next stage are one rank, and megatron-core 0.16 posts the shape exchange
            # of variable-length micro-batches (p2p_communication._communicate_shapes) to it in an order that pairs
            # the two directions' messages crosswise: gloo hangs there
            raise ValueError(f"parallel.virtual: {self.virtual} virtual stages need parallel.pipeline >= 3 (got "
                             f"{self.pipeline}): megatron-core's interleaved schedule pairs its shape messages "
                             "crosswise when both neighbours are one rank")

    @property
    def model_parallel_ranks(self) -> int:
        """TP x PP x CP x EP: the ranks one model replica spans (what a local run spawns when no world is given)."""
        return self.tensor * self.pipeline * self.context * self.expert

    @property
    def sequence_multiple(self) -> int:
        """Sequences are padded to a multiple of this: TP, as sequence parallelism splits them over TP; with
        CP > 1, CP x lcm(2, TP): 2 x CP equal chunks, and each CP rank's two chunks split over TP."""
        return self.context * math.lcm(2, self.tensor) if self.context > 1 else self.tensor


def pipeline_layer_counts(num_layers: int, parallel: ParallelConfig) -> list[int]:
    """Decoder layers per pipeline stage: parallel.first/last_stage_layers where set, the rest split evenly over the
    other stages (megatron's get_num_layers_to_build). ValueError naming the fields when they do not add up."""
    pp, first, last = parallel.pipeline, parallel.first_stage_layers, parallel.last_stage_layers
    if pp == 1:
        return [num_layers]
    fixed = [i for i, n in ((0, first), (pp - 1, last)) if n]
    rest, middle = num_layers - first - last, pp - len(fixed)
    if rest < 0 or (middle and rest % middle) or (not middle and rest):
        what = f"model.num_layers = {num_layers} over parallel.pipeline = {pp}"
        if fixed:
            what += f" with first_stage_layers = {first}, last_stage_layers = {last}"
        raise ValueError(f"{what}: the layers cannot be split ({rest} left for {middle} stage(s)); set "
                         "parallel.first_stage_layers / last_stage_layers so that the other stages share the rest "
                         "evenly")
    counts = [rest // middle if middle else 0] * pp
    for i in fixed:
        counts[i] = first if i == 0 else last
    if 0 in counts:
        raise ValueError(f"model.num_layers = {num_layers} over parallel.pipeline = {pp}: a stage would hold no "
                         f"layer ({counts})")
    if parallel.virtual > 1 and any(n % parallel.virtual for n in counts):
        raise ValueError(f"parallel.virtual = {parallel.virtual}: every pipeline stage's layers must split into that "
                         f"many equal chunks; model.num_layers = {num_layers} over parallel.pipeline = {pp} gives "
                         f"stages of {counts} layers")
    return counts


def pipeline_layer_range(num_layers: int, parallel: ParallelConfig, stage: int, chunk: int = 0) -> range:
    """The global decoder-layer indices of model chunk `chunk` of pipeline stage `stage` (the stage's only chunk
    without virtual stages). With V = parallel.virtual chunks of c_p / V layers on stage p (c_p its layer count),
    chunk v of stage p starts at v x num_layers / V + sum_{q < p} c_q / V (megatron's get_transformer_layer_offset)."""
    counts = [n // parallel.virtual for n in pipeline_layer_counts(num_layers, parallel)]
    start = chunk * sum(counts) + sum(counts[:stage])
    return range(start, start + counts[stage])


def stage_layer_indices(num_layers: int, parallel: ParallelConfig, stage: int) -> list[int]:
    """Every global decoder-layer index of pipeline stage `stage`, its chunks in order."""
    return [i for v in range(parallel.virtual) for i in pipeline_layer_range(num_layers, parallel, stage, v)]


def expert_tensor_parallel_size(parallel: ParallelConfig) -> int:
    """parallel.expert_tensor when set; else megatron's default (the TP size), except with expert parallelism on
    CPU: there 1, because the all-to-all
    dispatcher then all-gathers uneven token counts over expert-TP, which gloo cannot. (With EP = 1 it must stay
    TP: megatron marks expert weights as dense when EP = 1, and an expert-TP of 1 < TP would then leave their
    gradients unsummed over the TP ranks that each routed a different sequence chunk.)"""
    if parallel.expert_tensor:
        return parallel.expert_tensor
    if parallel.expert > 1 and not torch.cuda.is_available():
        return 1
    return parallel.tensor


@dataclass(frozen=True)
class ExportRoles:
    """A rank's part in a bucketed export of its pipeline stage (`models.hf.hf_buckets_from_model`). dense: takes
    part in the TP gathers (data- and context-parallel rank 0: the other replicas hold the same shards and sit out);
    expert: takes part in the expert-TP and EP gathers (expert-data-parallel rank 0); sender: the one rank of the
    stage that receives every gather and yields the buckets (all its ranks 0: the first rank of the stage)."""

    dense: bool
    expert: bool
    sender: bool


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """This rank's process groups and its place in the layout, read once from megatron at start-up
    (`initialize_parallel`) and passed down. `groups` is megatron's `ProcessGroupCollection` (its modules take it as
    `pg_collection`); the ranks and sizes are plain ints: reading them costs nothing after start-up."""

    config: ParallelConfig
    groups: object  # megatron.core.process_groups_config.ProcessGroupCollection
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    dp: int  # data-parallel replicas: world / (TP x CP x PP)
    ep_rank: int
    etp_rank: int
    etp: int  # expert-tensor-parallel size (`expert_tensor_parallel_size`)
    pipeline_ranks: tuple[int, ...]  # the global rank of each stage of this rank's pipeline
    replicas: tuple[tuple[int, ...], ...]  # replicas[d]: the global ranks holding DP rank d's data (a replica)
    replica_group: object  # this rank's replica's group, None for a one-rank replica
    roles: ExportRoles
    own_groups: tuple = ()  # groups made here (the replica groups under CP), destroyed by `close`

    @property
    def tp(self) -> int:
        return self.config.tensor

    @property
    def pp(self) -> int:
        return self.config.pipeline

    @property
    def cp(self) -> int:
        return self.config.context

    @property
    def ep(self) -> int:
        return self.config.expert

    @property
    def tp_group(self):
        """The TP group when TP > 1, else None: the `group` of the vocab-parallel functions (None: one process, no
        collective)."""
        return self.groups.tp if self.tp > 1 else None

    @property
    def cp_group(self):
        """The CP group (a sequence's tokens, split) when CP > 1, else None."""
        return self.groups.cp if self.cp > 1 else None

    @property
    def dp_group(self):
        return self.groups.dp

    @property
    def dp_cp_group(self):
        """DP x CP: the ranks whose losses and metrics add up to the step's (megatron's DDP sums gradients over it)."""
        return self.groups.dp_cp

    @property
    def pp_group(self):
        return self.groups.pp

    def is_first_stage(self, vp_stage: int | None = None) -> bool:
        """Whether model chunk `vp_stage` (the only one: None) of this rank holds the embedding."""
        return self.pp_rank == 0 and (vp_stage is None or vp_stage == 0)

    def is_last_stage(self, vp_stage: int | None = None) -> bool:
        """Whether model chunk `vp_stage` (the only one: None) of this rank holds the final norm and output layer."""
        return self.pp_rank == self.pp - 1 and (vp_stage is None or vp_stage == self.config.virtual - 1)

    def chunk_layers(self, num_layers: int) -> list[range]:
        """The global decoder layers of each of this rank's model chunks (`pipeline_layer_range`)."""
        return [pipeline_layer_range(num_layers, self.config, self.pp_rank, v) for v in range(self.config.virtual)]

    def moe_layers(self, model) -> list[int]:
        """The MoE layers of this rank's model chunks (global indices, chunk after chunk) of `model` (a ModelConfig):
        those whose routing it replays (R3), the only ones of a batch's routed experts it keeps."""
        return [i for layers in self.chunk_layers(model.num_layers) for i in layers if model.is_moe_layer(i)]

    def routed_columns(self, t: torch.Tensor) -> torch.Tensor:
        """The columns of [B, S] `t` that this rank's MoE routers see: under sequence parallelism (TP > 1), this TP
        rank's chunk of the sequence; all of them otherwise."""
        if self.tp == 1:
            return t
        S = t.shape[1] // self.tp
        return t[:, self.tp_rank * S : (self.tp_rank + 1) * S]

    def close(self) -> None:
        """Destroy the groups made here and megatron's (`destroy_parallel`); the context is unusable after. Once:
        a second call does nothing, and megatron's groups are left alone when a newer context replaced them (or
        the world is gone)."""
        if getattr(self, "_closed", False):
            return
        object.__setattr__(self, "_closed", True)
        if not dist.is_initialized():  # the world destroyed every group with it
            return
        for g in self.own_groups:  # gloo groups keep polling threads: do not pile them up
            dist.destroy_process_group(g)
        from megatron.core import parallel_state

        if parallel_state.get_tensor_model_parallel_group(check_initialized=False) is self.groups.tp:
            destroy_parallel()

    def __enter__(self) -> ParallelContext:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def initialize_parallel(parallel: ParallelConfig, *, seed: int = 1234) -> ParallelContext:
    """megatron's process groups over the already initialised default process group, its RNG states, and the
    context every other module takes them from. Collective over the world: megatron's group creation, one
    all-gather of the DP ranks (the replicas), and with CP > 1 one new group per replica. Under NCCL, set this
    rank's CUDA device first (the all-gather runs on it)."""
    apply_cpu_patches()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    world = dist.get_world_size()
    model_parallel = parallel.tensor * parallel.pipeline * parallel.context
    if world % model_parallel:
        raise ValueError(f"parallel: tensor x pipeline x context = {model_parallel} must divide the world size "
                         f"{world}")
    destroy_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        context_parallel_size=parallel.context,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=expert_tensor_parallel_size(parallel),
        virtual_pipeline_model_parallel_size=parallel.virtual if parallel.virtual > 1 else None,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    dp_rank, dp = dist.get_rank(groups.dp), dist.get_world_size(groups.dp)
    dp_of_rank = [None] * world
    dist.all_gather_object(dp_of_rank, dp_rank)  # the ranks that train on the same data
    replicas = tuple(tuple(r for r, d in enumerate(dp_of_rank) if d == k) for k in range(dp))
    own, replica_group = (), None
    if len(replicas[dp_rank]) > 1:
        if parallel.context == 1:  # megatron's model-parallel group (TP x PP) is the replica
            replica_group = groups.mp
            assert tuple(sorted(dist.get_process_group_ranks(replica_group))) == replicas[dp_rank]
        else:  # TP x CP x PP: megatron has no such group (collective: every rank makes every group, in order)
            made = [dist.new_group(list(r)) for r in replicas]  # a non-member gets GroupMember.NON_GROUP_MEMBER
            replica_group = made[dp_rank]
            own = (replica_group,)
    rank = {name: dist.get_rank(getattr(groups, name)) for name in ("tp", "pp", "cp", "ep", "expt_tp", "expt_dp")}
    dense = dp_rank == 0 and rank["cp"] == 0
    expert = rank["expt_dp"] == 0
    roles = ExportRoles(dense, expert, dense and expert and rank["tp"] == 0 and rank["ep"] == 0
                        and rank["expt_tp"] == 0)
    return ParallelContext(
        config=parallel, groups=groups, tp_rank=rank["tp"], pp_rank=rank["pp"], cp_rank=rank["cp"], dp_rank=dp_rank,
        dp=dp, ep_rank=rank["ep"], etp_rank=rank["expt_tp"], etp=dist.get_world_size(groups.expt_tp),
        pipeline_ranks=tuple(dist.get_global_rank(groups.pp, s) for s in range(parallel.pipeline)),
        replicas=replicas, replica_group=replica_group, roles=roles, own_groups=own)


def destroy_parallel() -> None:
    """megatron's parallel_state torn down and its process groups destroyed and freed. Each gloo group keeps three
    polling threads until the object is freed, and four things keep it: destroy_model_parallel only forgets
    most of its groups (not _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP*), the lru_cache on RotaryEmbedding.forward
    keeps every model's rope module (with its cp_group), the MoE auxiliary-loss tracker (a module-level dict) keeps
    each MoE layer's reduce groups, and megatron's modules form reference cycles. Without
    this, re-initialising in a long-lived process (a test pool, the analysis' seeds) piles up ~100 threads a run.
    Costs one full garbage collection (~0.1 s here; more with a large model's objects alive)."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding
    from megatron.core.transformer.moe import moe_utils

    groups, names = {}, []
    for name, value in vars(parallel_state).items():
        for g in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(g, dist.ProcessGroup) and g is not dist.GroupMember.WORLD:
                groups[id(g)] = g
                names.append(name)
    parallel_state.destroy_model_parallel()
    for name in names:  # the globals destroy_model_parallel leaves set
        setattr(parallel_state, name, None)
    for g in groups.values():
        try:
            dist.destroy_process_group(g)
        except ValueError:  # a group that destroy_model_parallel does not reset, destroyed here before
            pass
    groups.clear()
    moe_utils.get_moe_layer_wise_logging_tracker().clear()  # holds each MoE layer's reduce / avg groups
    rotary_pos_embedding.RotaryEmbedding.forward.cache_clear()
    yarn_rotary_pos_embedding.YarnRotaryEmbedding.forward.cache_clear()
    gc.collect()
