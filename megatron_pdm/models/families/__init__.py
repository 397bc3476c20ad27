"""One home per model family: its HF architecture and the declarative list of its tensors (`Tensor`: megatron
name, HF names, shapes from the config, TP split kind, what the planner counts it as). The HF <-> megatron map
(`models.hf`), the weight sync's element counts (`train.weight_sync`) and the planner's parameter counts
(`plan.count_parameters`) are all derived from `layer_tensors` / `model_tensors`; a new family is one module here
and one line in `FAMILIES`."""

from __future__ import annotations

from math import prod

from . import deepseek_v3, llama, qwen2, qwen3, qwen3_moe
from ._parts import Family, Tensor

FAMILIES: dict[str, Family] = {f.model_type: f for f in (qwen3.FAMILY, qwen3_moe.FAMILY, qwen2.FAMILY, llama.FAMILY,
                                                          deepseek_v3.FAMILY)}

__all__ = ["FAMILIES", "Family", "Tensor", "layer_tensors", "model_tensors", "numel"]


def layer_tensors(cfg, i: int) -> list[Tensor]:
    """Global decoder layer i's tensors, names relative to `decoder.layers.<local>.` / `model.layers.<i>.`."""
    return FAMILIES[cfg.model_type].layer(cfg, i)


def model_tensors(cfg, *, first: bool, last: bool) -> tuple[list[Tensor], list[Tensor]]:
    """(the tensors before the decoder layers, those after) of a model chunk: the embedding on the first chunk, the
    final norm and the untied output layer on the last."""
    H, V = cfg.hidden_size, cfg.vocab_size
    head = [Tensor("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", ((V, H),),
                   "embedding")] if first else []
    tail = [Tensor("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", ((H,),), "final_norm")]
    if not cfg.tie_word_embeddings:
        tail.append(Tensor("output_layer.weight", ("lm_head.weight",), "vocab", ((V, H),), "output"))
    return head, tail if last else []


def numel(t: Tensor) -> int:
    """Elements of a tensor's HF tensors together (one export / sync item)."""
    return sum(prod(s) for s in t.shapes)
