"""The building blocks the families share: the tensor record, the family record, and the layer parts (norms, GQA,
multi-latent attention, the SwiGLU MLP, the MoE block). Shapes are the HF tensors' ([out, in] for a linear).
`cfg` is a models.config.ModelConfig everywhere (not imported: config.py imports this package for its model types)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

# how a tensor is split over tensor parallelism and combined from its HF tensors (models.hf implements each):
# replicated; col / row (output / input dim); vocab (vocabulary rows); qkv (q / k / v fused per query group);
# glu ([gate; up] per TP shard); expert / expert_glu (one routed expert's row / glu weight, over EP and expert TP)
KINDS = ("replicated", "col", "row", "vocab", "qkv", "glu", "expert", "expert_glu", "tied_copy")
# what the planner counts a tensor as (plan.ParameterCount's fields)
PARTS = ("embedding", "output", "final_norm", "attention", "dense_mlp", "router", "shared_expert", "routed_expert")


@dataclass(frozen=True)
class Tensor:
    megatron: str  # megatron-core name (a routed expert's: `mlp.experts.local_experts.{local}.<w>#<global expert>`)
    hf: tuple[str, ...]  # the HF tensors it is made of, in the order the kind combines them
    kind: str  # one of KINDS
    shapes: tuple[tuple[int, ...], ...]  # each HF tensor's shape
    part: str  # one of PARTS
    parameter: bool = True  # False: a megatron buffer (DeepSeek-V3's router expert bias), synced but not counted


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type, ModelConfig.model_type
    hf_architecture: str  # config.json's architectures[0]
    # global decoder layer i's tensors; they depend on i only through cfg.is_moe_layer(i) (the planner and the
    # sync's counts build one list per kind of layer)
    layer: Callable[..., list[Tensor]]
    # config.json -> this family's ModelConfig fields beyond the common ones (`models.hf.config.model_config_from_hf`
    # reads those); ValueError naming the key for an architecture this builder would compute differently
    from_hf: Callable[[dict], dict]
    # ModelConfig -> config.json: the common dict (`models.hf.config.hf_config_dict`) with this family's keys
    to_hf: Callable[..., dict]
    moe: bool = False  # routes over experts (num_experts >= 1)


def refuse_attention_bias(d: dict, family: str) -> None:
    """ValueError for q / k / v biases in a family that builds none."""
    if d.get("attention_bias"):
        raise ValueError(f"config.json: attention_bias {json.dumps(d['attention_bias'])} ({family} with q / k / v "
                         "biases) is not supported")


def norm(megatron: str, hf: str, size: int, part: str) -> Tensor:
    return Tensor(megatron, (hf,), "replicated", ((size,),), part)


def gqa(cfg, *, bias: bool, qk_norm: bool, out: str = "o_proj") -> list[Tensor]:
    """Grouped-query attention: q / k / v fused per query group (optionally their bias, Qwen2), per-head RMSNorm
    on queries and keys (Qwen3), the output projection (its HF name `out`)."""
    H, n, g, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
    a, x = "self_attention.", "self_attn."
    rows = [Tensor(a + "linear_qkv.weight", (x + "q_proj.weight", x + "k_proj.weight", x + "v_proj.weight"), "qkv",
                   ((n * d, H), (g * d, H), (g * d, H)), "attention")]
    if bias:
        rows.append(Tensor(a + "linear_qkv.bias", (x + "q_proj.bias", x + "k_proj.bias", x + "v_proj.bias"), "qkv",
                           ((n * d,), (g * d,), (g * d,)), "attention"))
    if qk_norm:
        rows += [norm(a + "q_layernorm.weight", x + "q_norm.weight", d, "attention"),
                 norm(a + "k_layernorm.weight", x + "k_norm.weight", d, "attention")]
    return rows + [Tensor(a + "linear_proj.weight", (x + out + ".weight",), "row", ((H, n * d),), "attention")]


def mla(cfg) -> list[Tensor]:
    """Multi-latent attention: per head [nope; rope] (q) and [k_nope; v] (kv) rows on both sides; q-LoRA when
    q_lora_rank > 0."""
    H, n, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    q, kv, r, v = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
    a, x = "self_attention.", "self_attn."
    if q:
        rows = [Tensor(a + "linear_q_down_proj.weight", (x + "q_a_proj.weight",), "replicated", ((q, H),),
                       "attention"),
                norm(a + "q_layernorm.weight", x + "q_a_layernorm.weight", q, "attention"),
                Tensor(a + "linear_q_up_proj.weight", (x + "q_b_proj.weight",), "col", ((n * (d + r), q),),
                       "attention")]
    else:
        rows = [Tensor(a + "linear_q_proj.weight", (x + "q_proj.weight",), "col", ((n * (d + r), H),), "attention")]
    return rows + [
        Tensor(a + "linear_kv_down_proj.weight", (x + "kv_a_proj_with_mqa.weight",), "replicated",  # [latent; rope]
               ((kv + r, H),), "attention"),
        norm(a + "kv_layernorm.weight", x + "kv_a_layernorm.weight", kv, "attention"),
        Tensor(a + "linear_kv_up_proj.weight", (x + "kv_b_proj.weight",), "col", ((n * (d + v), kv),), "attention"),
        Tensor(a + "linear_proj.weight", (x + "o_proj.weight",), "row", ((H, n * v),), "attention"),
    ]


def swiglu(megatron: str, hf: str, H: int, F: int, part: str, kinds=("glu", "row")) -> list[Tensor]:
    """A SwiGLU MLP of width F: megatron's fused [gate; up] and its down projection."""
    return [Tensor(megatron + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), kinds[0],
                   ((F, H), (F, H)), part),
            Tensor(megatron + "linear_fc2.weight", (hf + "down_proj.weight",), kinds[1], ((H, F),), part)]


def decoder_layer(cfg, i: int, attention: list[Tensor], *, expert_bias: bool = False) -> list[Tensor]:
    """A pre-norm decoder layer: input norm, `attention`, pre-MLP norm, then a dense SwiGLU MLP or (an MoE layer)
    the router (its expert bias when `expert_bias`), the shared expert (width moe_shared_expert_ffn_hidden_size,
    none at 0) and every routed expert."""
    H = cfg.hidden_size
    rows = [norm("input_layernorm.weight", "input_layernorm.weight", H, "attention"), *attention,
            norm("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", H, "dense_mlp")]
    if not cfg.is_moe_layer(i):
        return rows + swiglu("mlp.", "mlp.", H, cfg.ffn_hidden_size, "dense_mlp")
    E, S = cfg.num_experts, cfg.moe_shared_expert_ffn_hidden_size
    rows.append(Tensor("mlp.router.weight", ("mlp.gate.weight",), "replicated", ((E, H),), "router"))
    if expert_bias:  # a buffer on both sides: routing differs silently if it is not loaded
        rows.append(Tensor("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), "replicated", ((E,),),
                           "router", parameter=False))
    if S:
        rows += swiglu("mlp.shared_experts.", "mlp.shared_experts.", H, S, "shared_expert")
    for e in range(E):
        for t in swiglu("mlp.experts.local_experts.{local}.", f"mlp.experts.{e}.", H, cfg.moe_ffn_hidden_size,
                        "routed_expert", kinds=("expert_glu", "expert")):
            rows.append(Tensor(f"{t.megatron}#{e}", t.hf, t.kind, t.shapes, t.part))
    return rows
