"""`ModelConfig`: a Qwen3 / Qwen3-MoE layout (RMSNorm, SwiGLU, RoPE, GQA, QK-norm, top-k router) as one dataclass."""

from __future__ import annotations

from dataclasses import dataclass, fields

from megatron_pdm._dataclass import from_dict

MODEL_TYPES = ("qwen3", "qwen3_moe")


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

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model.model_type: unknown model type {self.model_type!r}; expected one of "
                             f"{', '.join(MODEL_TYPES)}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"model.{f.name}: expected an integer, got {v!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "head_dim",
                     "ffn_hidden_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"model.num_query_groups: {self.num_query_groups} must divide num_attention_heads = "
                             f"{self.num_attention_heads}")
        if (self.model_type == "qwen3_moe") != (self.num_experts > 0):
            raise ValueError(f"model.num_experts: {self.num_experts} with model_type {self.model_type!r} (qwen3 is "
                             "dense: 0 experts; qwen3_moe needs >= 1)")
        if self.num_experts and not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(f"model.moe_router_topk: {self.moe_router_topk} must be in [1, {self.num_experts}]")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        return from_dict(cls, d, "model")
