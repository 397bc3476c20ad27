"""config.json <-> ModelConfig: the HF config translation of every family (`hf_config_dict`, `model_config_from_hf`)
and the architecture comparison of a checkpoint with a run's model."""

from __future__ import annotations

import json
from dataclasses import fields

from ..config import MODEL_TYPE_ALIASES, ROPE_SCALINGS, ModelConfig
from ..families import FAMILIES

HF_ARCHITECTURES = {t: f.hf_architecture for t, f in FAMILIES.items()}


# ---------------------------------------------------------------------------------------------- configs


def _rope_dict(cfg: ModelConfig) -> dict | None:
    """The rope scaling block as config.json spells it (None without scaling)."""
    if cfg.rope_scaling == "llama3":
        return {"rope_type": "llama3", "factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position_embeddings}
    if cfg.rope_scaling == "yarn":
        return {"rope_type": "yarn", "factor": cfg.rope_scaling_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position_embeddings,
                "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow, "mscale": cfg.rope_mscale,
                "mscale_all_dim": cfg.rope_mscale_all_dim}
    return None


def hf_config_dict(cfg: ModelConfig) -> dict:
    """config.json contents of the HF model equivalent to `cfg`."""
    rope = _rope_dict(cfg)
    d = {
        "architectures": [HF_ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # what SGLang / vLLM / transformers<5 read, with rope_scaling
        "rope_scaling": rope,
        "rope_parameters": {"rope_type": "default", **(rope or {}), "rope_theta": cfg.rope_theta},  # transformers>=5
        "attention_bias": cfg.qkv_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if cfg.model_type == "qwen3_moe":
        d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                 moe_intermediate_size=cfg.moe_ffn_hidden_size, norm_topk_prob=cfg.moe_norm_topk_prob,
                 decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=cfg.moe_aux_loss_coeff,
                 output_router_logits=False)
    elif cfg.model_type == "qwen2":
        d.update(use_sliding_window=False, sliding_window=None)
        del d["head_dim"], d["attention_bias"]  # Qwen2: hidden_size / heads, and always a q / k / v bias
    elif cfg.model_type == "llama":
        d.update(mlp_bias=False)
    elif cfg.model_type == "deepseek_v3":
        groups = cfg.moe_router_num_groups or 1
        d.update(head_dim=cfg.qk_rope_head_dim, qk_nope_head_dim=cfg.head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                 v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
                 rope_interleave=True, n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                 moe_intermediate_size=cfg.moe_ffn_hidden_size,
                 n_shared_experts=cfg.moe_shared_expert_ffn_hidden_size // cfg.moe_ffn_hidden_size,
                 first_k_dense_replace=cfg.moe_first_k_dense, moe_layer_freq=1, n_group=groups,
                 topk_group=cfg.moe_router_group_topk or groups, routed_scaling_factor=cfg.moe_routed_scaling_factor,
                 norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
                 num_nextn_predict_layers=cfg.mtp_num_layers)
    return d


def _rope_from_hf(d: dict, model_type: str) -> dict:
    """ModelConfig's rope fields from config.json: `rope_parameters` (transformers>=5) or the legacy `rope_theta`
    + `rope_scaling` (`type` or `rope_type`), as the released DeepSeek-V3 / Kimi-K2 / Llama-3 files spell it."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if params.get("rope_type", "default") != "default" or not scaling:
        scaling = params
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    out = {"rope_theta": float(d.get("rope_theta") or params.get("rope_theta") or 1e4)}
    if kind == "default":
        return out
    allowed = [k for k, types in ROPE_SCALINGS.items() if k != "none" and model_type in types]
    if kind not in allowed:
        raise ValueError(f"config.json: rope scaling {kind!r} with model_type {model_type!r} is not supported"
                         + (f" (supported: {', '.join(allowed)})" if allowed else ""))
    out.update(rope_scaling=kind, rope_scaling_factor=float(scaling["factor"]),
               rope_original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                   rope_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)))
    else:  # transformers' YaRN defaults where a key is absent
        out.update(rope_beta_fast=float(scaling.get("beta_fast") or 32), rope_beta_slow=float(scaling.get("beta_slow")
                   or 1), rope_mscale=float(scaling.get("mscale") or 1), rope_mscale_all_dim=float(
                   scaling.get("mscale_all_dim") or 0))
    return out


# transformers' names (ACT2FN) of SiLU, the gated MLP's activation in every family here; absent, each family's
# config class defaults to "silu"
SILU_NAMES = ("silu", "swish")
# transformers' norm_topk_prob where config.json has none: Qwen3MoeConfig's False (the top-k softmax weights
# are not renormalised), DeepseekV3Config's True
NORM_TOPK_PROB_DEFAULT = {"qwen3_moe": False, "deepseek_v3": True}


def _norm_topk_prob(d: dict, model_type: str) -> bool:
    """Whether the router renormalises its top-k weights: config.json's norm_topk_prob, else transformers'."""
    return d.get("norm_topk_prob", NORM_TOPK_PROB_DEFAULT[model_type])


def _check_hf_layers(d: dict, model_type: str) -> None:
    """ValueError naming the key and its value for layers this builder would compute differently: an activation
    other than SiLU (the model's MLP is always a SiLU GLU), Qwen3's q / k / v biases (it builds none)."""
    act = d.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (the {model_type} MLP is a SiLU GLU: "
                         "hidden_act 'silu')")
    if model_type in ("qwen3", "qwen3_moe") and d.get("attention_bias"):
        raise ValueError(f"config.json: attention_bias {json.dumps(d['attention_bias'])} (Qwen3 with q / k / v "
                         "biases) is not supported")


def model_config_from_hf(d: dict) -> ModelConfig:
    """ModelConfig from an HF config.json dict (Qwen3, Qwen3-MoE, Qwen2, Llama, DeepSeek-V3 / Kimi-K2). ValueError
    naming the key for an architecture this builder would compute differently. A key config.json leaves out takes
    transformers' default for the model type."""
    model_type = MODEL_TYPE_ALIASES.get(d.get("model_type"), d.get("model_type"))
    if model_type not in HF_ARCHITECTURES:
        raise ValueError(f"config.json: model_type {d.get('model_type')!r} is not supported; expected one of "
                         f"{', '.join(HF_ARCHITECTURES)} (or {', '.join(MODEL_TYPE_ALIASES)})")
    _check_hf_layers(d, model_type)
    kw = dict(
        model_type=model_type, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
        num_query_groups=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        ffn_hidden_size=d["intermediate_size"], norm_eps=d.get("rms_norm_eps", 1e-6),
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=d.get("tie_word_embeddings", False), **_rope_from_hf(d, model_type),
    )
    if model_type == "qwen3_moe":
        if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
            raise ValueError("config.json: Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step) "
                             "is not supported")
        kw.update(num_experts=d["num_experts"], moe_router_topk=d["num_experts_per_tok"],
                  moe_ffn_hidden_size=d["moe_intermediate_size"], moe_norm_topk_prob=_norm_topk_prob(d, "qwen3_moe"),
                  moe_aux_loss_coeff=d.get("router_aux_loss_coef", 1e-3))
    elif model_type == "qwen2":
        if d.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window true (Qwen2 sliding-window attention) is not supported")
        kw["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    elif model_type == "llama":
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise ValueError(f"config.json: {key} true (Llama with biases) is not supported")
    elif model_type == "deepseek_v3":
        kw.update(_deepseek_v3_from_hf(d))
    return ModelConfig(**kw)


def _deepseek_v3_from_hf(d: dict) -> dict:
    if d.get("scoring_func", "sigmoid") != "sigmoid" or d.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"config.json: scoring_func {d.get('scoring_func')!r} / topk_method {d.get('topk_method')!r}"
                         ": only DeepSeek-V3's sigmoid scores with the expert bias (noaux_tc) are supported")
    if d.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"config.json: moe_layer_freq {d['moe_layer_freq']} (only 1: every layer after the first "
                         "first_k_dense_replace routes)")
    if d.get("attention_bias"):
        raise ValueError("config.json: attention_bias true is not supported for DeepSeek-V3")
    groups = d.get("n_group") or 1
    return dict(
        head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
        q_lora_rank=d.get("q_lora_rank") or 0, kv_lora_rank=d["kv_lora_rank"],
        num_query_groups=d["num_attention_heads"], num_experts=d["n_routed_experts"],
        moe_router_topk=d["num_experts_per_tok"], moe_ffn_hidden_size=d["moe_intermediate_size"],
        moe_shared_expert_ffn_hidden_size=(d.get("n_shared_experts") or 0) * d["moe_intermediate_size"],
        moe_first_k_dense=d.get("first_k_dense_replace", 0), moe_norm_topk_prob=_norm_topk_prob(d, "deepseek_v3"),
        moe_router_num_groups=groups if groups > 1 else 0,
        moe_router_group_topk=(d.get("topk_group") or groups) if groups > 1 else 0,
        moe_routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        moe_aux_loss_coeff=0.0,  # RL: no balance loss (slime, mbridge); model.moe_aux_loss_coeff sets one
        mtp_num_layers=d.get("num_nextn_predict_layers", 0) or 0,
    )


# model settings that a config may set beside a checkpoint's architecture
NOT_ARCHITECTURE = frozenset({"tokenizer", "moe_aux_loss_coeff", "moe_router_bias_update_rate",
                              "moe_token_dispatcher_type", "moe_enable_deepep", "moe_grouped_gemm"})


def architecture_mismatches(cfg: ModelConfig, ckpt: ModelConfig) -> list[str]:
    """`model.<field>: <cfg value> (checkpoint: <value>)` for every architecture field where the two differ."""
    return [f"model.{f.name}: {getattr(cfg, f.name)!r} (checkpoint: {getattr(ckpt, f.name)!r})"
            for f in fields(ModelConfig) if f.name not in NOT_ARCHITECTURE
            and getattr(cfg, f.name) != getattr(ckpt, f.name)]
