"""A scratch family (issue 55's count): Llama with its attention output projection named `out_proj`."""

from ._parts import Family, decoder_layer, gqa
from .llama import from_hf

FAMILY = Family("llama_outproj", "LlamaOutProjForCausalLM",
                lambda cfg, i: decoder_layer(cfg, i, gqa(cfg, bias=False, qk_norm=False, out="out_proj")),
                from_hf=from_hf, to_hf=lambda cfg, d: d | {"mlp_bias": False})
