"""megatron-core `GPTModel` builders for the families of `ModelConfig` (Qwen3, Qwen2, Llama, DeepSeek-V3).

The local (non-Transformer-Engine) layer spec on CPU, the TE spec when Transformer Engine imports. Tensor,
pipeline, expert, context and sequence parallelism come from the `ParallelContext` the caller built
(`models.parallel.initialize_parallel`), whose process groups the models take as megatron's `pg_collection`.
Sequence parallelism is on whenever TP > 1 (megatron requires it for MoE with TP). Context parallelism runs through
TE's attention on a GPU and through `ContextParallelAttention` (the same function, keys and values all-gathered) on
the local spec.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import types
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron_pdm.compat import (
    apply_cpu_patches,
    cuda_to_cpu_scope,
    patch_expert_bias_padding,
    patch_mla_q_projection,
    patch_mla_without_te,
)

from .attention import ContextParallelAttention
from .config import ModelConfig
from .layout import has_dense_layers
from .parallel import ParallelConfig, ParallelContext, expert_tensor_parallel_size, pipeline_layer_counts


def te_available() -> bool:
    """Transformer Engine usable: only with CUDA (a CPU install of TE breaks `import megatron.core`)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, RuntimeError):
        return False
    return True


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with megatron's norm-constructor signature, usable under sequence parallelism: its weights
    carry `sequence_parallel` so that `finalize_model_grads` sums their gradients over TP. In params_dtype and on the
    device megatron puts every other weight (the current GPU unless use_cpu_initialization): a float32 norm in a
    bf16 model fell outside the mixed-precision optimizer's float16 groups, whose checkpoint then failed."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        device = "cpu" if config.use_cpu_initialization else torch.device("cuda", torch.cuda.current_device())
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype, device=device)
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)


def transformer_config(cfg: ModelConfig, parallel: ParallelConfig, *, params_dtype=torch.float32,
                       bf16: bool = False, fp16: bool = False, **overrides):
    """The megatron TransformerConfig of `cfg` (an MLATransformerConfig for deepseek_v3); `overrides` are passed
    through (e.g. calculate_per_token_loss)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    tp = parallel.tensor
    moe = {}
    if cfg.is_moe:
        moe = dict(
            num_moe_experts=cfg.num_experts,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
            moe_router_topk=cfg.moe_router_topk,
            moe_router_pre_softmax=not cfg.moe_norm_topk_prob,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            # flex: DeepEP's kernels (moe_enable_deepep, megatron's deprecated spelling of this backend)
            **(dict(moe_flex_dispatcher_backend="deepep") if cfg.moe_token_dispatcher_type == "flex" else {}),
            moe_grouped_gemm=cfg.moe_grouped_gemm,
            moe_permute_fusion=False,
            moe_router_dtype="fp32",
            expert_model_parallel_size=parallel.expert,
            expert_tensor_parallel_size=expert_tensor_parallel_size(parallel),
        )
    if cfg.model_type == "deepseek_v3":
        # sigmoid scores; the expert bias picks the experts, the unbiased scores weight them (normalised, then
        # scaled); DeepSeek's sequence-wise balance loss only when asked (RL: none, as slime and mbridge run it)
        moe.update(
            moe_router_pre_softmax=False,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=cfg.moe_router_bias_update_rate,
            moe_router_num_groups=cfg.moe_router_num_groups or None,
            moe_router_group_topk=cfg.moe_router_group_topk or None,
            moe_router_topk_scaling_factor=cfg.moe_routed_scaling_factor,
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_ffn_hidden_size or None,
            moe_layer_freq=[int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)],
            moe_router_load_balancing_type="seq_aux_loss" if cfg.moe_aux_loss_coeff else "none",
        )
    common = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        qk_layernorm=cfg.qk_norm or cfg.multi_latent_attention,  # MLA: the q / kv latent norms
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel.pipeline,
        context_parallel_size=parallel.context,
        num_layers_in_first_pipeline_stage=parallel.first_stage_layers or None,
        num_layers_in_last_pipeline_stage=parallel.last_stage_layers or None,
        virtual_pipeline_model_parallel_size=parallel.virtual if parallel.virtual > 1 else None,
        sequence_parallel=tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        fp16=fp16,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        # alltoall for dense models too: megatron validates it against variable_seq_lengths (pipeline parallelism)
        moe_token_dispatcher_type=cfg.moe_token_dispatcher_type if cfg.is_moe else "alltoall",
        **moe,
        **overrides,
    )
    if not cfg.multi_latent_attention:
        return TransformerConfig(**common)
    yarn = cfg.rope_scaling == "yarn"
    return MLATransformerConfig(
        **{**common, "kv_channels": cfg.v_head_dim},  # the local core attention sizes its output by kv_channels
        q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.head_dim,  # megatron's qk_head_dim is the no-RoPE part
        qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rotary_base=cfg.rope_theta,
        rope_type="yarn" if yarn else "rope",
        # megatron's YaRN defaults (factor 40, beta 32 / 1, mscale_all_dim 0) are never used: the checkpoint's values
        rotary_scaling_factor=cfg.rope_scaling_factor if yarn else 1.0,
        original_max_position_embeddings=cfg.rope_original_max_position_embeddings or cfg.max_position_embeddings,
        beta_fast=cfg.rope_beta_fast,
        beta_slow=cfg.rope_beta_slow,
        mscale=cfg.rope_mscale if yarn else 1.0,
        mscale_all_dim=cfg.rope_mscale_all_dim if yarn else 0.0,
    )


def llama3_inv_freq(cfg: ModelConfig, dim: int) -> torch.Tensor:
    """[dim / 2] float32 RoPE inverse frequencies with Llama-3 scaling: f_i = theta^(-2i / dim), wavelength
    w_i = 2 pi / f_i; f_i / factor where w_i > L / low_freq_factor, f_i where w_i < L / high_freq_factor, else
    (1 - s) f_i / factor + s f_i with s = (L / w_i - low) / (high - low), L the original context length.
    (megatron's own `rope_scaling` fixes low / high / L at 1 / 4 / 8192; checkpoints set them.)"""
    f = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    L, low, high = cfg.rope_original_max_position_embeddings, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / f
    s = ((L / wavelen - low) / (high - low)).clamp(0, 1)
    scaled = (1 - s) * f / cfg.rope_scaling_factor + s * f
    return torch.where(wavelen > L / low, f / cfg.rope_scaling_factor, torch.where(wavelen < L / high, f, scaled))


@functools.cache
def mla_core_attention():
    """megatron's local `DotProductAttention` for multi-latent attention: takes the k_channels / v_channels that
    MLA passes (TE's signature; q / k heads of nope + rope dims, v heads of v_head_dim) and sizes its output
    [s, b, heads / tp x v_head_dim] by the value head dim. A class made at first use (megatron imports lazily)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLACoreAttention(DotProductAttention):
        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(config, *args, **kwargs)
            if v_channels is not None:  # megatron's Attention first builds one without them (kv_channels = v dim)
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLACoreAttention


def _local_spec(cfg: ModelConfig, tconfig, num_experts: int | None):
    """megatron's local layer spec with our RMSNorm in every norm slot (sequence parallel), the context-parallel
    attention under CP, and for MLA: the q / kv down-projections replicated over TP (megatron's column-parallel
    ones leave the shared RoPE key's gradient unsummed over TP, Megatron-LM #1699; replicated, as the TE spec has
    them, `finalize_model_grads` sums it) and a core attention taking MLA's head dims."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.identity_op import IdentityOp

    mla = cfg.multi_latent_attention
    spec = copy.deepcopy(gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=tconfig.qk_layernorm,
        multi_latent_attention=mla, normalization="RMSNorm"))
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    attn = sub.self_attention.submodules
    if mla:  # a q norm only with q compression (Kimi-K2 has none; megatron-core 0.17+ refuses an unused one)
        attn.q_layernorm, attn.kv_layernorm = (RMSNorm if cfg.q_lora_rank else IdentityOp), RMSNorm
        attn.linear_q_down_proj = attn.linear_kv_down_proj = Linear
        attn.core_attention = mla_core_attention()
    elif cfg.qk_norm:
        attn.q_layernorm = attn.k_layernorm = RMSNorm
    if tconfig.context_parallel_size > 1:
        attn.core_attention = ContextParallelAttention
    return spec


def layer_spec(cfg: ModelConfig, tconfig, vp_stage: int | None = None):
    """Block submodules of model chunk `vp_stage` (None without virtual stages): a dense or an MoE layer spec for
    each of its global layers (deepseek_v3's first moe_first_k_dense layers are dense), megatron's TE spec when
    Transformer Engine is usable, else its local spec with our substitutions (`_local_spec`)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    start = get_transformer_layer_offset(tconfig, vp_stage=vp_stage)
    layers = range(start, start + get_num_layers_to_build(tconfig, vp_stage=vp_stage))
    te = te_available()

    def spec(moe: bool):
        experts = cfg.num_experts if moe else None
        if te:  # grouped GEMM: TE's grouped linear (`moe_kernel_problem` refuses it elsewhere)
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=experts, moe_grouped_gemm=cfg.moe_grouped_gemm, qk_layernorm=tconfig.qk_layernorm,
                multi_latent_attention=cfg.multi_latent_attention)
        return _local_spec(cfg, tconfig, experts)

    kinds = {moe: spec(moe) for moe in set(map(cfg.is_moe_layer, layers))}  # one spec per kind of layer
    if te:
        from megatron.core.extensions.transformer_engine import TENorm
    return TransformerBlockSubmodules(layer_specs=[kinds[cfg.is_moe_layer(i)] for i in layers],
                                      layer_norm=TENorm if te else RMSNorm)


def build_model(cfg: ModelConfig, parallel: ParallelContext, **kwargs):
    """A GPTModel holding this rank's shards, for layouts without virtual pipeline stages (`build_model_chunks`
    otherwise)."""
    if parallel.config.virtual > 1:
        raise ValueError(f"parallel.virtual: {parallel.config.virtual} model chunks per stage; use build_model_chunks")
    return build_model_chunks(cfg, parallel, **kwargs)[0]


def model_chunks(model) -> list:
    """A model as megatron's list of chunks: `model` itself when it is a list, else [model]."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def moe_kernel_problem(cfg: ModelConfig, *, cuda: bool, transformer_engine: bool, deep_ep: bool) -> str | None:
    """Why this machine cannot run `cfg`'s MoE settings (the field, its value and what it needs), or None: DeepEP's
    flex dispatcher is CUDA kernels (the `deep_ep` package); grouped GEMM runs the local experts through Transformer
    Engine's grouped linear (megatron's other grouped MLP, the `grouped_gemm` package's, keeps a weight layout the
    checkpoint mapping does not read), which needs CUDA."""
    if not cfg.is_moe:
        return None
    if cfg.moe_token_dispatcher_type == "flex" and not (cuda and deep_ep):
        return (f"model.moe_token_dispatcher_type: 'flex' (moe_enable_deepep) runs DeepEP's CUDA kernels, which "
                f"this machine lacks (cuda={cuda}, deep_ep={deep_ep}); use alltoall")
    if cfg.moe_grouped_gemm and not (cuda and transformer_engine):
        return (f"model.moe_grouped_gemm: true runs Transformer Engine's grouped GEMM kernels, which this machine "
                f"lacks (cuda={cuda}, transformer_engine={transformer_engine}); set it false")
    return None


def check_moe_kernels(cfg: ModelConfig) -> None:
    """ValueError (`moe_kernel_problem`) when this machine cannot run `cfg`'s MoE settings."""
    import importlib.util

    problem = moe_kernel_problem(cfg, cuda=torch.cuda.is_available(), transformer_engine=te_available(),
                                 deep_ep=importlib.util.find_spec("deep_ep") is not None)
    if problem:
        raise ValueError(problem)


def check_model_fits(cfg: ModelConfig, parallel: ParallelConfig) -> None:
    """ValueError naming the field when `cfg` cannot be split over `parallel`."""
    if cfg.vocab_size % parallel.tensor:
        raise ValueError(f"model.vocab_size: {cfg.vocab_size} must be divisible by the tensor-parallel size "
                         f"{parallel.tensor} (pad the vocabulary)")
    if cfg.num_query_groups % parallel.tensor:
        raise ValueError(f"model.num_query_groups: {cfg.num_query_groups} must be divisible by the tensor-parallel "
                         f"size {parallel.tensor}")
    if has_dense_layers(cfg) and cfg.ffn_hidden_size % parallel.tensor:
        raise ValueError(f"model.ffn_hidden_size: {cfg.ffn_hidden_size} must be divisible by the tensor-parallel "
                         f"size {parallel.tensor}")
    if cfg.is_moe and cfg.num_experts % parallel.expert:
        raise ValueError(f"model.num_experts: {cfg.num_experts} must be divisible by the expert-parallel size "
                         f"{parallel.expert}")
    etp = expert_tensor_parallel_size(parallel)  # what the model is built with (parallel.expert_tensor 0: TP)
    if cfg.is_moe and cfg.moe_ffn_hidden_size % etp:
        raise ValueError(f"model.moe_ffn_hidden_size: {cfg.moe_ffn_hidden_size} must be divisible by the "
                         f"expert-tensor-parallel size {etp} (parallel.expert_tensor = {parallel.expert_tensor})")
    if cfg.is_moe and cfg.moe_shared_expert_ffn_hidden_size % parallel.tensor:
        raise ValueError(f"model.moe_shared_expert_ffn_hidden_size: {cfg.moe_shared_expert_ffn_hidden_size} must be "
                         f"divisible by the tensor-parallel size {parallel.tensor}")
    pipeline_layer_counts(cfg.num_layers, parallel)  # a clear error when the stages cannot split the layers


def build_model_chunks(cfg: ModelConfig, ctx: ParallelContext, *, params_dtype=torch.float32, bf16=False,
                       fp16=False, **overrides) -> list:
    """This rank's model chunks, GPTModels holding its shards: one per virtual pipeline stage (parallel.virtual;
    one without), chunk v holding the layers `ctx.chunk_layers(..)[v]`, the embedding on chunk 0 of the first stage
    and the output layer on the last chunk of the last stage. They share one TransformerConfig and take the
    context's process groups. Multi-token-prediction layers are not built (RL trains the main model)."""
    apply_cpu_patches()
    from megatron.core.models.gpt import GPTModel

    parallel = ctx.config
    check_model_fits(cfg, parallel)
    check_moe_kernels(cfg)
    if cfg.multi_latent_attention:
        patch_mla_q_projection()
        if not te_available():
            patch_mla_without_te()
    if cfg.model_type == "deepseek_v3":
        patch_expert_bias_padding()
    tconfig = transformer_config(cfg, parallel, params_dtype=params_dtype, bf16=bf16, fp16=fp16, **overrides)
    stages = [None] if parallel.virtual == 1 else range(parallel.virtual)
    # tied embeddings over pipeline stages: megatron gives the last stage a copy of the embedding as its output
    # layer (zeroed, then all-reduced over the first and last stages' embedding group so that it equals the first
    # stage's; finalize_model_grads all-reduces the two copies' gradients there). The all-reduce moves the weight
    # with a hard-coded `.cuda()` (LanguageModule.setup_embeddings_and_output_layer), a no-op under the scope on a
    # CPU; on a GPU the scope is a null context and the weights are already there. MLA's YaRN slices its cos / sin
    # cache for the CP rank through a pinned host tensor at construction: the same scope on a CPU
    scoped = (cfg.tie_word_embeddings and parallel.pipeline > 1) or cfg.multi_latent_attention
    with cuda_to_cpu_scope() if scoped else contextlib.nullcontext():
        chunks = [GPTModel(
            config=tconfig,
            transformer_layer_spec=layer_spec(cfg, tconfig, vp),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_position_embeddings,
            pre_process=ctx.is_first_stage(vp),
            post_process=ctx.is_last_stage(vp),
            share_embeddings_and_output_weights=cfg.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(cfg.rope_theta),
            parallel_output=True,
            vp_stage=vp,
            pg_collection=ctx.groups,
        ) for vp in stages]
    for chunk in chunks:
        rope = getattr(chunk, "rotary_pos_emb", None)
        if cfg.rope_scaling == "llama3" and rope is not None:
            rope.inv_freq = llama3_inv_freq(cfg, cfg.head_dim).to(rope.inv_freq.device)
        if torch.cuda.is_available():  # the replicated MLA down-projections are allocated on the host
            chunk.cuda(torch.cuda.current_device())
    return chunks


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """[1, 1, S, S] boolean mask, True above the diagonal (masked), as megatron's attention takes it. Passed
    explicitly because megatron's default causal mask is allocated on CUDA."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu_(1)[None, None]


def forward_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits shard [B, S, V/tp] for right-padded input_ids [B, S] (positions 0..S-1, causal attention); from a
    chunk whose output layer is fused (`fuse_output_layer`), its hidden states times the output weight."""
    B, S = input_ids.shape
    position_ids = torch.arange(S, device=input_ids.device)[None].expand(B, S)
    out = model(input_ids, position_ids, causal_mask(S, input_ids.device))
    return out @ output_weight(model).t() if is_output_fused(model) else out


def _unwrap(model):
    return getattr(model, "module", model)  # megatron's DDP wraps the GPTModel


def output_weight(model) -> torch.Tensor | None:
    """The output layer's weight shard [V/tp, H] of a last-stage chunk (the embedding's when tied), None on other
    chunks."""
    model = _unwrap(model)
    if not model.post_process:
        return None
    return model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights \
        else model.output_layer.weight


def _hidden_output(layer, hidden, weight=None, runtime_gather_output=None):
    """ColumnParallelLinear.forward without the GEMM: the input as that layer would multiply it (over TP under
    sequence parallelism, its backward a reduce-scatter; otherwise marked for the all-reduce of its gradient over TP,
    as megatron's output layer does), and no bias."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

    if layer.sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                    group=layer.tp_group), None
    return copy_to_tensor_model_parallel_region(hidden, group=layer.tp_group), None


def fuse_output_layer(model) -> None:
    """Make a last-stage chunk return the output layer's input [B, S, H] instead of its logits [B, S, V/tp]: the
    loss then multiplies by `output_weight` chunk by chunk (`objectives.policy_loss_from_hidden`), and no logits
    tensor exists (train.fused_output_layer). The layer keeps its weight, so checkpoints, DDP, the optimizer and the
    weight sync see no change. A no-op on other chunks."""
    model = _unwrap(model)
    if model.post_process:
        layer = model.output_layer
        layer.forward = types.MethodType(_hidden_output, layer)  # a bound method: a deep copy rebinds it


def is_output_fused(model) -> bool:
    """Whether `model` (a last-stage chunk) returns hidden states (`fuse_output_layer`)."""
    model = _unwrap(model)
    return bool(model.post_process) and "forward" in vars(model.output_layer)


def _router_replays(model) -> list:
    """The RouterReplay of every MoE layer of this pipeline stage, in layer order (models built with
    moe_enable_routing_replay=True). Found on the model, not through megatron's class-level registry, which
    keeps the routers of every model ever built in the process."""
    return [m.router_replay for m in model.modules() if getattr(m, "router_replay", None) is not None]


def _recomputes_routing(config) -> bool:
    """Whether megatron's activation recompute runs the routers again in the backward pass: full recompute, or
    selective with the MoE layer among its modules."""
    return config.recompute_granularity == "full" or (
        config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or ()))


@contextmanager
def routing_replay(model, routed_experts: torch.Tensor | None, *, tp_group=None):
    """Route every MoE layer by `routed_experts` [B, S, layers, top_k] (the rollout engine's choices, R3) in the
    forward pass run inside; None routes as usual. Under sequence parallelism each TP rank's routers see tokens
    [S/tp * r, S/tp * (r + 1)) in (s, b) order, which is the slice given to each layer.
    With activation recompute and gradients on, the choices stay queued for the recomputed forward of the backward
    pass: megatron's RouterReplay queues every target it is given and its REPLAY_BACKWARD action pops them in order,
    which is the micro-batches' order (each model chunk runs its forwards and its backwards in the same order under
    every schedule of megatron's). The action is left at REPLAY_BACKWARD after the forward; `end_routing_replay`
    clears the queues once the schedule is done. Without a recompute to come the choices are cleared at once."""
    if routed_experts is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = _router_replays(model)
    if len(replays) != routed_experts.shape[2]:
        raise ValueError(f"routed_experts: {routed_experts.shape[2]} layers, the model has {len(replays)} MoE layers "
                         "on this stage (build it with moe_enable_routing_replay=True)")
    B, S = routed_experts.shape[:2]
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    r = dist.get_rank(tp_group) if tp_group is not None else 0
    local = routed_experts[:, r * S // tp : (r + 1) * S // tp].transpose(0, 1).long()  # [S/tp, B, layers, k]
    for layer, replay in enumerate(replays):
        replay.set_target_indices(local[:, :, layer].reshape(-1, local.shape[-1]))  # also queued for backward
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    recomputed = torch.is_grad_enabled() and _recomputes_routing(_unwrap(model).config)
    try:
        yield
    finally:
        for replay in replays:
            if recomputed:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                replay.clear_indices()
                replay.clear_router_replay_action()


def end_routing_replay(model) -> None:
    """Clear every router's queued replay choices and action: after a schedule whose forwards `routing_replay`
    queued for recompute (all popped by then, unless it raised, or a layer was not recomputed)."""
    for replay in _router_replays(model):
        replay.clear_indices()
        replay.clear_router_replay_action()
