"""Llama 3.x / SmolLM2: GQA without bias or QK-norm, SwiGLU."""

from ._parts import Family, decoder_layer, gqa

FAMILY = Family("llama", "LlamaForCausalLM", lambda cfg, i: decoder_layer(cfg, i, gqa(cfg, bias=False, qk_norm=False)))
