"""DeepSeek-V3 / Kimi-K2: multi-latent attention, dense MLPs in the first moe_first_k_dense layers, then MoE with a
shared expert and a sigmoid router whose expert bias (`e_score_correction_bias`) is a checkpoint buffer."""

from ._parts import Family, decoder_layer, mla

FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM",
                lambda cfg, i: decoder_layer(cfg, i, mla(cfg), expert_bias=True), moe=True)
