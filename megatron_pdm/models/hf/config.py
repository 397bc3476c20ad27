"""config.json <-> ModelConfig: the HF config translation of every family (`hf_config_dict`, `model_config_from_hf`)
and the architecture comparison of a checkpoint with a run's model."""

from __future__ import annotations

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
    return FAMILIES[cfg.model_type].to_hf(cfg, d)


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


def _check_hf_layers(d: dict, model_type: str) -> None:
    """ValueError naming the key and its value for layers this builder would compute differently: an activation
    other than SiLU (the model's MLP is always a SiLU GLU); each family checks its own (`Family.from_hf`)."""
    act = d.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (the {model_type} MLP is a SiLU GLU: "
                         "hidden_act 'silu')")


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
    kw.update(FAMILIES[model_type].from_hf(d))
    return ModelConfig(**kw)


# model settings that a config may set beside a checkpoint's architecture
NOT_ARCHITECTURE = frozenset({"tokenizer", "moe_aux_loss_coeff", "moe_router_bias_update_rate",
                              "moe_token_dispatcher_type", "moe_enable_deepep", "moe_grouped_gemm"})


def architecture_mismatches(cfg: ModelConfig, ckpt: ModelConfig) -> list[str]:
    """`model.<field>: <cfg value> (checkpoint: <value>)` for every architecture field where the two differ."""
    return [f"model.{f.name}: {getattr(cfg, f.name)!r} (checkpoint: {getattr(ckpt, f.name)!r})"
            for f in fields(ModelConfig) if f.name not in NOT_ARCHITECTURE
            and getattr(cfg, f.name) != getattr(ckpt, f.name)]
