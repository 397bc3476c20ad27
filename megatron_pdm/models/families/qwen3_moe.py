"""Qwen3-MoE: Qwen3's attention, every layer a top-k softmax-routed MoE without a shared expert."""

from ._parts import Family, decoder_layer, gqa, refuse_attention_bias


def from_hf(d: dict) -> dict:
    refuse_attention_bias(d, "Qwen3")
    if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
        raise ValueError("config.json: Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step) "
                         "is not supported")
    return dict(num_experts=d["num_experts"], moe_router_topk=d["num_experts_per_tok"],
                moe_ffn_hidden_size=d["moe_intermediate_size"],
                moe_norm_topk_prob=d.get("norm_topk_prob", False),  # Qwen3MoeConfig's default: not renormalised
                moe_aux_loss_coeff=d.get("router_aux_loss_coef", 1e-3))


def to_hf(cfg, d: dict) -> dict:
    return d | dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                    moe_intermediate_size=cfg.moe_ffn_hidden_size, norm_topk_prob=cfg.moe_norm_topk_prob,
                    decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=cfg.moe_aux_loss_coeff,
                    output_router_logits=False)


FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM",
                lambda cfg, i: decoder_layer(cfg, i, gqa(cfg, bias=False, qk_norm=True)), from_hf=from_hf,
                to_hf=to_hf, moe=True)
