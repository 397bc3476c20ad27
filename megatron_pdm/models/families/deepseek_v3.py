"""DeepSeek-V3 / Kimi-K2: multi-latent attention, dense MLPs in the first moe_first_k_dense layers, then MoE with a
shared expert and a sigmoid router whose expert bias (`e_score_correction_bias`) is a checkpoint buffer."""

from ._parts import Family, decoder_layer, mla


def from_hf(d: dict) -> dict:
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
        moe_first_k_dense=d.get("first_k_dense_replace", 0),
        moe_norm_topk_prob=d.get("norm_topk_prob", True),  # DeepseekV3Config's default
        moe_router_num_groups=groups if groups > 1 else 0,
        moe_router_group_topk=(d.get("topk_group") or groups) if groups > 1 else 0,
        moe_routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        moe_aux_loss_coeff=0.0,  # RL: no balance loss (slime, mbridge); model.moe_aux_loss_coeff sets one
        mtp_num_layers=d.get("num_nextn_predict_layers", 0) or 0,
    )


def to_hf(cfg, d: dict) -> dict:
    groups = cfg.moe_router_num_groups or 1
    return d | dict(head_dim=cfg.qk_rope_head_dim, qk_nope_head_dim=cfg.head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                    v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
                    rope_interleave=True, n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                    moe_intermediate_size=cfg.moe_ffn_hidden_size,
                    n_shared_experts=cfg.moe_shared_expert_ffn_hidden_size // cfg.moe_ffn_hidden_size,
                    first_k_dense_replace=cfg.moe_first_k_dense, moe_layer_freq=1, n_group=groups,
                    topk_group=cfg.moe_router_group_topk or groups,
                    routed_scaling_factor=cfg.moe_routed_scaling_factor, norm_topk_prob=True, scoring_func="sigmoid",
                    topk_method="noaux_tc", num_nextn_predict_layers=cfg.mtp_num_layers)


FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM",
                lambda cfg, i: decoder_layer(cfg, i, mla(cfg), expert_bias=True), from_hf=from_hf, to_hf=to_hf,
                moe=True)
