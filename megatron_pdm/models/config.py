"""`ModelConfig`: the decoder families megatron-pdm builds, as one dataclass.

- qwen3 / qwen3_moe: RMSNorm, SwiGLU, RoPE, GQA, QK-norm (and a top-k softmax router).
- qwen2 (Qwen2, Qwen2.5, Qwen2.5-Math): bias on the q / k / v projections, no QK-norm.
- llama (Llama 3.x, SmolLM2): no bias, no QK-norm, optional Llama-3 RoPE scaling (`rope_scaling: llama3`).
- deepseek_v3 (DeepSeek-V3, Kimi-K2; `kimi_k2` is an alias): multi-latent attention with YaRN, dense MLPs in the
  first `moe_first_k_dense` layers, a shared expert, sigmoid routing with an expert bias chosen within the top
  `moe_router_group_topk` of `moe_router_num_groups` expert groups, weights scaled by `moe_routed_scaling_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megatron_pdm._dataclass import from_dict
from megatron_pdm._validate import check_bool, check_choice, check_int, check_number

from .families import FAMILIES

MODEL_TYPES = tuple(FAMILIES)  # one module each in models/families/
MOE_TYPES = tuple(t for t, f in FAMILIES.items() if f.moe)
MOE_DISPATCHERS = ("alltoall", "allgather", "flex")  # megatron's token dispatchers (flex: DeepEP's kernels)
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}  # Kimi-K2's config.json: the DeepSeek-V3 architecture
ROPE_SCALINGS = {"none": MODEL_TYPES, "llama3": ("llama",), "yarn": ("deepseek_v3",)}


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's architecture, field for field the HF config.json of the checkpoint it loads or exports
    (`models.hf.model_config_from_hf` / `hf_config_dict`; the HF key is named on each field), plus the few settings
    of how megatron runs it (MoE dispatch, grouped GEMM, the tokenizer); the module docstring lists the families.
    With train.init hf the section defaults to the checkpoint's config.json, and what it sets must match it; the
    defaults here are a tiny qwen3 for tests."""

    model_type: str = "qwen3"  # HF model_type: the family (qwen3, qwen3_moe, qwen2, llama, deepseek_v3; or kimi_k2)
    vocab_size: int = 128  # HF vocab_size: the token ids, rows of the embedding and of the output layer
    hidden_size: int = 64  # HF hidden_size: the residual stream width
    num_layers: int = 2  # HF num_hidden_layers: decoder layers (MTP layers not counted)
    num_attention_heads: int = 4  # HF num_attention_heads: query heads
    num_query_groups: int = 2  # HF num_key_value_heads: key/value heads (GQA groups; divides the query heads)
    # HF head_dim: the q / k / v head size (qwen2: hidden_size / heads; deepseek_v3: HF qk_nope_head_dim)
    head_dim: int = 16
    ffn_hidden_size: int = 128  # HF intermediate_size: the dense SwiGLU MLP's inner width
    num_experts: int = 0  # HF num_experts (deepseek_v3: n_routed_experts): routed experts per MoE layer (0: dense)
    moe_ffn_hidden_size: int = 32  # HF moe_intermediate_size: each routed expert's inner width
    moe_router_topk: int = 2  # HF num_experts_per_tok: the experts each token is routed to
    # HF router_aux_loss_coef: the load-balancing loss weight (deepseek_v3: sequence-wise, 0 when loaded; 0: none)
    moe_aux_loss_coeff: float = 1e-3
    moe_norm_topk_prob: bool = True  # HF norm_topk_prob: renormalise a token's top-k router weights to sum to 1
    rope_theta: float = 1_000_000.0  # HF rope_theta: the RoPE base
    norm_eps: float = 1e-6  # HF rms_norm_eps: the RMSNorm epsilon
    max_position_embeddings: int = 512  # HF max_position_embeddings: the longest sequence, prompt + response (tokens)
    tie_word_embeddings: bool = False  # HF tie_word_embeddings: the output layer shares the embedding's weights
    # RoPE scaling: "none", "llama3" (llama: inverse frequencies with wavelength above original / low_freq_factor
    # divided by the factor, below original / high_freq_factor kept, interpolated between) or "yarn" (deepseek_v3:
    # NTK-by-parts between beta_fast and beta_slow rotations, attention scaled by mscale(factor, mscale_all_dim)^2)
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0  # HF rope_scaling.factor: the context extension factor (llama3, yarn)
    # HF rope_scaling.original_max_position_embeddings: the context before extension (tokens; llama3, yarn)
    rope_original_max_position_embeddings: int = 0
    rope_low_freq_factor: float = 1.0  # HF rope_scaling.low_freq_factor (llama3): wavelengths > original / this scaled
    rope_high_freq_factor: float = 4.0  # HF rope_scaling.high_freq_factor (llama3): wavelengths < original / this kept
    rope_beta_fast: float = 32.0  # HF rope_scaling.beta_fast (yarn): dims with more rotations are kept
    rope_beta_slow: float = 1.0  # HF rope_scaling.beta_slow (yarn): dims with fewer rotations are divided by factor
    # HF rope_scaling.mscale (yarn): cos / sin scaled by mscale(factor, this) / mscale(factor, mscale_all_dim)
    rope_mscale: float = 1.0
    # HF rope_scaling.mscale_all_dim (yarn): softmax scale x mscale(factor, this)^2, mscale(f, m) = 0.1 m ln f + 1
    rope_mscale_all_dim: float = 0.0
    # deepseek_v3 only: dense MLPs in the first k layers, a shared expert beside the routed ones, and multi-latent
    # attention (head_dim is the no-RoPE query / key head dim; q_lora_rank 0 means no query compression)
    moe_first_k_dense: int = 0  # HF first_k_dense_replace: the first k decoder layers have dense MLPs
    # HF n_shared_experts x moe_intermediate_size: the shared expert's inner width (0: no shared expert)
    moe_shared_expert_ffn_hidden_size: int = 0
    q_lora_rank: int = 0  # HF q_lora_rank: the query compression rank (0: no compression, a plain q_proj)
    kv_lora_rank: int = 0  # HF kv_lora_rank: the compressed key / value latent width
    qk_rope_head_dim: int = 0  # HF qk_rope_head_dim: the RoPE part of each query / key head
    v_head_dim: int = 0  # HF v_head_dim: the value head size
    # deepseek_v3 routing (0 groups: no group limit), the expert-bias update rate (0: the checkpoint's bias stays,
    # as slime runs RL; u > 0: b += u sign(mean load - load) once per optimizer step) and the checkpoint's
    # multi-token-prediction layers (not built: RL trains the main model)
    moe_router_num_groups: int = 0  # HF n_group: the expert groups of group-limited routing (0: no group limit)
    moe_router_group_topk: int = 0  # HF topk_group: the expert groups a token routes within (0: no group limit)
    moe_routed_scaling_factor: float = 1.0  # HF routed_scaling_factor: multiplies the routed experts' weights
    moe_router_bias_update_rate: float = 0.0  # not in HF: u, the expert-bias update per optimizer step (0: bias fixed)
    mtp_num_layers: int = 0  # HF num_nextn_predict_layers: MTP layers, carried into exports, never built or trained
    # how the trainer's MoE layers run (megatron's settings, not the architecture): the token dispatcher (alltoall;
    # allgather: every rank of the EP x TP group gathers all its tokens; flex: DeepEP's fused dispatch and combine,
    # with moe_enable_deepep) and grouped GEMM for a rank's local experts (Transformer Engine's grouped linear).
    # flex and grouped GEMM need CUDA kernels (`models.gpt.moe_kernel_problem`)
    moe_token_dispatcher_type: str = "alltoall"  # megatron's MoE token dispatcher (flex: DeepEP's kernels)
    moe_enable_deepep: bool = False  # DeepEP's fused dispatch / combine: true exactly with the flex dispatcher
    moe_grouped_gemm: bool = False  # a rank's local experts as one grouped GEMM (Transformer Engine, CUDA only)
    # the tokenizer directory (transformers files); default: the HF checkpoint directory with train.init hf
    tokenizer: str | None = None

    def __post_init__(self):
        if self.model_type in MODEL_TYPE_ALIASES:
            object.__setattr__(self, "model_type", MODEL_TYPE_ALIASES[self.model_type])
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model.model_type: unknown model type {self.model_type!r}; expected one of "
                             f"{', '.join(MODEL_TYPES)} (or the alias {', '.join(MODEL_TYPE_ALIASES)})")
        positive = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "head_dim",
                    "ffn_hidden_size", "max_position_embeddings")
        for f in fields(self):
            if f.type == "int":
                check_int(f"model.{f.name}", getattr(self, f.name), lo=1 if f.name in positive else 0)
            elif f.type == "float":  # rope_theta, norm_eps, the scaling factors: > 0; rates and coefficients >= 0
                check_number(f"model.{f.name}", getattr(self, f.name), lo=0, finite=True,
                             lo_open=f.name in ("rope_theta", "norm_eps", "rope_scaling_factor"))
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"model.num_query_groups: {self.num_query_groups} must divide num_attention_heads = "
                             f"{self.num_attention_heads}")
        if (self.model_type in MOE_TYPES) != (self.num_experts > 0):
            raise ValueError(f"model.num_experts: {self.num_experts} with model_type {self.model_type!r} (qwen3, "
                             f"qwen2 and llama are dense: 0 experts; {' and '.join(MOE_TYPES)} need >= 1)")
        if self.rope_scaling not in ROPE_SCALINGS or self.model_type not in ROPE_SCALINGS[self.rope_scaling]:
            allowed = [k for k, types in ROPE_SCALINGS.items() if self.model_type in types]
            raise ValueError(f"model.rope_scaling: {self.rope_scaling!r} with model_type {self.model_type!r}; "
                             f"expected one of {', '.join(allowed)}")
        if self.rope_scaling != "none" and (self.rope_scaling_factor < 1
                                            or self.rope_original_max_position_embeddings < 1):
            raise ValueError(f"model.rope_scaling_factor / rope_original_max_position_embeddings: "
                             f"{self.rope_scaling_factor} / {self.rope_original_max_position_embeddings} with "
                             f"rope_scaling {self.rope_scaling!r} (expected >= 1 each)")
        if self.rope_scaling == "yarn" and self.rope_beta_fast < self.rope_beta_slow:  # equal: Kimi-K2's 1 / 1
            raise ValueError(f"model.rope_beta_fast: {self.rope_beta_fast} must be >= rope_beta_slow "
                             f"{self.rope_beta_slow} (YaRN interpolates between the two)")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(f"model.rope_high_freq_factor: {self.rope_high_freq_factor} must exceed "
                             f"rope_low_freq_factor {self.rope_low_freq_factor}")
        mla = ("moe_first_k_dense", "moe_shared_expert_ffn_hidden_size", "q_lora_rank", "kv_lora_rank",
               "qk_rope_head_dim", "v_head_dim", "moe_router_num_groups", "moe_router_group_topk",
               "moe_router_bias_update_rate", "mtp_num_layers")
        for name in mla:
            if self.model_type != "deepseek_v3" and getattr(self, name):
                raise ValueError(f"model.{name}: {getattr(self, name)} (only for model_type deepseek_v3)")
        if self.model_type != "deepseek_v3" and self.moe_routed_scaling_factor != 1:
            raise ValueError(f"model.moe_routed_scaling_factor: {self.moe_routed_scaling_factor} (only for "
                             "model_type deepseek_v3)")
        if self.model_type == "qwen2" and self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(f"model.head_dim: {self.head_dim} x num_attention_heads {self.num_attention_heads} must "
                             f"equal hidden_size {self.hidden_size} for qwen2 (its config.json has no head_dim)")
        if self.model_type == "deepseek_v3":
            self._check_deepseek_v3()
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ValueError(f"model.tokenizer: expected a directory path, got {self.tokenizer!r}")
        if self.num_experts and not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(f"model.moe_router_topk: {self.moe_router_topk} must be in [1, {self.num_experts}]")
        check_choice("model.moe_token_dispatcher_type", self.moe_token_dispatcher_type, MOE_DISPATCHERS)
        check_bool("model.moe_enable_deepep", self.moe_enable_deepep)
        check_bool("model.moe_grouped_gemm", self.moe_grouped_gemm)
        if self.is_moe and self.moe_enable_deepep != (self.moe_token_dispatcher_type == "flex"):  # flex is DeepEP
            raise ValueError(f"model.moe_enable_deepep: {self.moe_enable_deepep} with moe_token_dispatcher_type "
                             f"{self.moe_token_dispatcher_type!r}: DeepEP runs as megatron's flex dispatcher; set "
                             "both (flex and true) or neither")

    def _check_deepseek_v3(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}: must be >= 1 for deepseek_v3 (multi-latent attention)")
        if self.num_query_groups != self.num_attention_heads:
            raise ValueError(f"model.num_query_groups: {self.num_query_groups} must equal num_attention_heads "
                             f"{self.num_attention_heads} for multi-latent attention")
        if self.moe_first_k_dense >= self.num_layers:
            raise ValueError(f"model.moe_first_k_dense: {self.moe_first_k_dense} must be < num_layers "
                             f"{self.num_layers}")
        if not self.moe_norm_topk_prob:
            raise ValueError("model.moe_norm_topk_prob: false with deepseek_v3; megatron-core's sigmoid router "
                             "always normalises the top-k weights (DeepSeek-V3 and Kimi-K2 set norm_topk_prob true)")
        if self.moe_shared_expert_ffn_hidden_size % self.moe_ffn_hidden_size:
            raise ValueError(f"model.moe_shared_expert_ffn_hidden_size: {self.moe_shared_expert_ffn_hidden_size} must "
                             f"be a multiple of moe_ffn_hidden_size {self.moe_ffn_hidden_size} (n_shared_experts)")
        if self.moe_router_num_groups == 1:  # one group is no group limit
            object.__setattr__(self, "moe_router_num_groups", 0)
            object.__setattr__(self, "moe_router_group_topk", 0)
        groups, picked, k = self.moe_router_num_groups, self.moe_router_group_topk, self.moe_router_topk
        if bool(groups) != bool(picked):
            raise ValueError(f"model.moe_router_num_groups / moe_router_group_topk: {groups} / {picked} (set both, or "
                             "neither)")
        if groups > 1:
            if self.num_experts % groups or not 1 <= picked <= groups:
                raise ValueError(f"model.moe_router_num_groups / moe_router_group_topk: {groups} / {picked} (the "
                                 f"groups must divide num_experts {self.num_experts}; 1 <= group_topk <= groups)")
            # megatron scores a group by the sum of its top-(k / group_topk) experts, DeepSeek's reference and
            # transformers by its top-2: the two choose the same groups only in these cases
            if picked != groups and k != 2 * picked:
                raise ValueError(f"model.moe_router_group_topk: {picked} of {groups} groups with moe_router_topk "
                                 f"{k}: megatron-core scores a group by its top-{k // picked} experts, the "
                                 "checkpoint's router by its top-2, so they would route differently; supported: "
                                 "group_topk = num_groups, or moe_router_topk = 2 x group_topk (DeepSeek-V3: 8 of "
                                 "8 groups pick 4 with top-8; Kimi-K2: one group)")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def multi_latent_attention(self) -> bool:
        return self.model_type == "deepseek_v3"

    @property
    def qk_norm(self) -> bool:
        """RMSNorm on each query and key head (Qwen3); MLA's latent norms are separate (`multi_latent_attention`)."""
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def qkv_bias(self) -> bool:
        """A bias on the q / k / v projections (Qwen2)."""
        return self.model_type == "qwen2"

    def is_moe_layer(self, i: int) -> bool:
        """Whether global decoder layer i routes over experts (deepseek_v3: all but the first moe_first_k_dense)."""
        return self.is_moe and i >= self.moe_first_k_dense

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        return from_dict(cls, d, "model")
