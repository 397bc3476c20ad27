"""A parallel layout of the training ranks and megatron-core's rules for it, beside `ParallelConfig`.

`Layout` is a `ParallelConfig` resolved on a world size: TP / PP / EP / CP sizes, the data parallelism the world
leaves, the expert tensor parallelism and the pipeline stages' layer counts. `layout_problem` says why megatron-core
would reject a layout for a model; `layout_of` resolves a `ParallelConfig` on `world` ranks and raises that reason.
Pure Python (no process group): the trainer's config checks (`Config.check_world_size`) and the planner
(`megatron_pdm.cluster.plan`) both use them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig
from .parallel import ParallelConfig, pipeline_layer_counts


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    ep: int
    cp: int
    dp: int
    etp: int  # expert tensor parallelism
    first_stage_layers: int = 0  # 0: an even share (parallel.first_stage_layers)
    last_stage_layers: int = 0
    virtual: int = 1  # model chunks per pipeline stage (parallel.virtual)

    @property
    def edp(self) -> int:
        """Expert data parallelism: megatron folds the dense TP x CP x DP ranks of a stage into ETP x EP x EDP."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def parallel(self) -> ParallelConfig:
        """The model-parallel sizes of this layout (data parallelism is what the world leaves)."""
        return ParallelConfig(tensor=self.tp, pipeline=self.pp, expert=self.ep, context=self.cp,
                              expert_tensor=self.etp, first_stage_layers=self.first_stage_layers,
                              last_stage_layers=self.last_stage_layers, virtual=self.virtual)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers per pipeline stage (`models.pipeline_layer_counts`); ValueError when they do not add up."""
        parallel = ParallelConfig(pipeline=self.pp, first_stage_layers=self.first_stage_layers,
                                  last_stage_layers=self.last_stage_layers, virtual=self.virtual)
        return pipeline_layer_counts(num_layers, parallel)

    def expert_a2a_crosses_nodes(self, gpus_per_node: int) -> bool:
        """Whether an expert-parallel group spans nodes: megatron places the EP x ETP ranks of an expert group on
        consecutive ranks, so its all-to-alls stay on NVLink iff EP x ETP fits in (and tiles) a node."""
        group = self.ep * self.etp
        return self.ep > 1 and (group > gpus_per_node or gpus_per_node % group != 0)

    def label(self) -> str:
        pp = f"PP{self.pp}"
        if self.first_stage_layers or self.last_stage_layers:
            pp += f"({self.first_stage_layers or '='}/{self.last_stage_layers or '='})"
        if self.virtual > 1:
            pp += f" VP{self.virtual}"
        s = f"TP{self.tp} {pp} CP{self.cp} DP{self.dp}"
        return s + (f" EP{self.ep} ETP{self.etp}" if self.ep > 1 or self.etp != self.tp else "")


def layout_of(model: ModelConfig, parallel: ParallelConfig, world: int, seq: int) -> Layout:
    """The layout `parallel` asks for on `world` training ranks (DP is what is left), for `model` trained on
    sequences of up to `seq` tokens. ValueError ("parallel: ...") when TP x PP x CP does not divide the world or
    megatron-core would reject the layout (`layout_problem`)."""
    p = parallel
    model_parallel = p.tensor * p.pipeline * p.context
    if world % model_parallel:
        raise ValueError(f"parallel: tensor x pipeline x context = {model_parallel} must divide the {world} training "
                         "GPUs")
    layout = Layout(p.tensor, p.pipeline, p.expert, p.context, world // model_parallel, p.expert_tensor or p.tensor,
                    p.first_stage_layers, p.last_stage_layers, p.virtual)
    problem = layout_problem(model, layout, seq)
    if problem:
        raise ValueError(f"parallel: {layout.label()} is not valid for this model: {problem}")
    return layout


def layout_problem(m: ModelConfig, lay: Layout, seq: int) -> str | None:
    """Why megatron-core would reject `lay` for `m` on sequences of `seq` tokens, or None."""
    if m.vocab_size % lay.tp:
        return f"vocab_size {m.vocab_size} is not divisible by TP {lay.tp}"
    if m.num_query_groups % lay.tp or m.num_attention_heads % lay.tp:
        return f"{m.num_query_groups} query groups / {m.num_attention_heads} heads are not divisible by TP {lay.tp}"
    if has_dense_layers(m) and m.ffn_hidden_size % lay.tp:  # a dense MLP's columns split over TP
        return f"ffn_hidden_size {m.ffn_hidden_size} is not divisible by TP {lay.tp}"
    try:
        lay.stage_layers(m.num_layers)
    except ValueError as e:
        return str(e)
    if not m.is_moe:
        return None if lay.ep == 1 and lay.etp == lay.tp else "EP / ETP need an MoE model"
    if m.num_experts % lay.ep:
        return f"{m.num_experts} experts are not divisible by EP {lay.ep}"
    if (lay.tp * lay.cp * lay.dp) % (lay.ep * lay.etp):
        return f"EP {lay.ep} x ETP {lay.etp} must divide TP x CP x DP = {lay.tp * lay.cp * lay.dp}"
    if m.moe_ffn_hidden_size % lay.etp:
        return f"moe_ffn_hidden_size {m.moe_ffn_hidden_size} is not divisible by ETP {lay.etp}"
    if m.moe_shared_expert_ffn_hidden_size % lay.tp:  # the shared expert is a dense MLP: split over TP, not ETP
        return (f"moe_shared_expert_ffn_hidden_size {m.moe_shared_expert_ffn_hidden_size} is not divisible by TP "
                f"{lay.tp}")
    if m.moe_token_dispatcher_type == "allgather" and lay.pp > 1:  # pipeline stages exchange variable shapes
        return (f"moe_token_dispatcher_type 'allgather' takes no variable sequence lengths, which PP {lay.pp} "
                "needs (use alltoall)")
    return None


def has_dense_layers(m: ModelConfig) -> bool:
    """Whether some decoder layer has a dense MLP (of ffn_hidden_size): a dense model's, DeepSeek-V3's first
    moe_first_k_dense; an all-MoE model builds none, its ffn_hidden_size unused."""
    return any(not m.is_moe_layer(i) for i in range(m.num_layers))
