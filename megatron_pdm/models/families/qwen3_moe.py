"""Qwen3-MoE: Qwen3's attention, every layer a top-k softmax-routed MoE without a shared expert."""

from ._parts import Family, decoder_layer, gqa

FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM",
                lambda cfg, i: decoder_layer(cfg, i, gqa(cfg, bias=False, qk_norm=True)), moe=True)
