"""Qwen2 / Qwen2.5: GQA with a bias on q / k / v, no QK-norm, SwiGLU."""

from ._parts import Family, decoder_layer, gqa

FAMILY = Family("qwen2", "Qwen2ForCausalLM", lambda cfg, i: decoder_layer(cfg, i, gqa(cfg, bias=True, qk_norm=False)))
