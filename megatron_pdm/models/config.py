"""`ModelConfig`: a Qwen3 / Qwen3-MoE layout (RMSNorm, SwiGLU, RoPE, GQA, QK-norm, top-k router) as one dataclass,
and the DeepSeek-V3 layout (multi-latent attention, leading dense layers, a shared expert) that the planner and the
cluster presets describe (megatron-core builds it; the HF mapping and the embedded engine cover the Qwen3 layouts)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from megatron_pdm._dataclass import from_dict
from megatron_pdm._validate import check_int

MODEL_TYPES = ("qwen3", "qwen3_moe", "deepseek_v3")
MOE_TYPES = ("qwen3_moe", "deepseek_v3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str = "qwen3"
    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    head_dim: int = 16
    ffn_hidden_size: int = 128
    num_experts: int = 0  # 0 for a dense model
    moe_ffn_hidden_size: int = 32
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 1e-3
    moe_norm_topk_prob: bool = True
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    # deepseek_v3 only: dense MLPs in the first k layers, a shared expert beside the routed ones, and multi-latent
    # attention (head_dim is the no-RoPE query / key head dim; q_lora_rank 0 means no query compression)
    moe_first_k_dense: int = 0
    moe_shared_expert_ffn_hidden_size: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # the tokenizer directory (transformers files); default: the HF checkpoint directory with train.init hf
    tokenizer: str | None = None

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model.model_type: unknown model type {self.model_type!r}; expected one of "
                             f"{', '.join(MODEL_TYPES)}")
        positive = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "head_dim",
                    "ffn_hidden_size", "max_position_embeddings")
        for f in fields(self):
            if f.type == "int":
                check_int(f"model.{f.name}", getattr(self, f.name), lo=1 if f.name in positive else None)
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"model.num_query_groups: {self.num_query_groups} must divide num_attention_heads = "
                             f"{self.num_attention_heads}")
        if (self.model_type in MOE_TYPES) != (self.num_experts > 0):
            raise ValueError(f"model.num_experts: {self.num_experts} with model_type {self.model_type!r} (qwen3 is "
                             f"dense: 0 experts; {' and '.join(MOE_TYPES)} need >= 1)")
        mla = ("moe_first_k_dense", "moe_shared_expert_ffn_hidden_size", "q_lora_rank", "kv_lora_rank",
               "qk_rope_head_dim", "v_head_dim")
        for name in mla:
            if getattr(self, name) < 0 or (self.model_type != "deepseek_v3" and getattr(self, name)):
                raise ValueError(f"model.{name}: {getattr(self, name)} (>= 0, and only for model_type deepseek_v3)")
        if self.model_type == "deepseek_v3":
            for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) < 1:
                    raise ValueError(f"model.{name}: must be >= 1 for deepseek_v3 (multi-latent attention)")
            if self.num_query_groups != self.num_attention_heads:
                raise ValueError(f"model.num_query_groups: {self.num_query_groups} must equal num_attention_heads "
                                 f"{self.num_attention_heads} for multi-latent attention")
            if self.moe_first_k_dense >= self.num_layers:
                raise ValueError(f"model.moe_first_k_dense: {self.moe_first_k_dense} must be < num_layers "
                                 f"{self.num_layers}")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ValueError(f"model.tokenizer: expected a directory path, got {self.tokenizer!r}")
        if self.num_experts and not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(f"model.moe_router_topk: {self.moe_router_topk} must be in [1, {self.num_experts}]")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def multi_latent_attention(self) -> bool:
        return self.model_type == "deepseek_v3"

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        return from_dict(cls, d, "model")
