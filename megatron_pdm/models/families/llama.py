"""Llama 3.x / SmolLM2: GQA without bias or QK-norm, SwiGLU."""

from ._parts import Family, decoder_layer, gqa


def from_hf(d: dict) -> dict:
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise ValueError(f"config.json: {key} true (Llama with biases) is not supported")
    return {}


FAMILY = Family("llama", "LlamaForCausalLM", lambda cfg, i: decoder_layer(cfg, i, gqa(cfg, bias=False, qk_norm=False)),
                from_hf=from_hf, to_hf=lambda cfg, d: d | {"mlp_bias": False})
