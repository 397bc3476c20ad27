"""Qwen2 / Qwen2.5: GQA with a bias on q / k / v, no QK-norm, SwiGLU."""

from ._parts import Family, decoder_layer, gqa


def from_hf(d: dict) -> dict:
    if d.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window true (Qwen2 sliding-window attention) is not supported")
    return {"head_dim": d["hidden_size"] // d["num_attention_heads"]}


def to_hf(cfg, d: dict) -> dict:
    d = d | dict(use_sliding_window=False, sliding_window=None)
    del d["head_dim"], d["attention_bias"]  # Qwen2: hidden_size / heads, and always a q / k / v bias
    return d


FAMILY = Family("qwen2", "Qwen2ForCausalLM", lambda cfg, i: decoder_layer(cfg, i, gqa(cfg, bias=True, qk_norm=False)),
                from_hf=from_hf, to_hf=to_hf)
