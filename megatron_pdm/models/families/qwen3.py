"""Qwen3 (dense): GQA with per-head QK-norm, no bias, SwiGLU."""

from ._parts import Family, decoder_layer, gqa, refuse_attention_bias


def from_hf(d: dict) -> dict:
    refuse_attention_bias(d, "Qwen3")
    return {}


FAMILY = Family("qwen3", "Qwen3ForCausalLM", lambda cfg, i: decoder_layer(cfg, i, gqa(cfg, bias=False, qk_norm=True)),
                from_hf=from_hf, to_hf=lambda cfg, d: d)
