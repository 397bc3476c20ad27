"""Qwen3 (dense): GQA with per-head QK-norm, no bias, SwiGLU."""

from ._parts import Family, decoder_layer, gqa

FAMILY = Family("qwen3", "Qwen3ForCausalLM", lambda cfg, i: decoder_layer(cfg, i, gqa(cfg, bias=False, qk_norm=True)))
