"""megatron-core models (Qwen3 dense and MoE) and their Hugging Face checkpoint mapping."""

from .config import ModelConfig
from .gpt import (
    ParallelConfig,
    build_model,
    build_model_chunks,
    causal_mask,
    destroy_parallel,
    forward_logits,
    initialize_parallel,
    model_chunks,
    pipeline_layer_counts,
    pipeline_layer_range,
    routing_replay,
    stage_layer_indices,
)
from .hf import (
    canonical_hf_state,
    hf_buckets_from_model,
    hf_config_dict,
    hf_state_from_model,
    load_hf_checkpoint,
    load_hf_into_model,
    model_config_from_hf,
    save_hf_checkpoint,
    stage_layers,
)
from .layout import Layout, layout_of, layout_problem

__all__ = [
    "ModelConfig",
    "ParallelConfig",
    "Layout",
    "layout_of",
    "layout_problem",
    "pipeline_layer_counts",
    "pipeline_layer_range",
    "build_model",
    "build_model_chunks",
    "canonical_hf_state",
    "causal_mask",
    "destroy_parallel",
    "forward_logits",
    "hf_buckets_from_model",
    "hf_config_dict",
    "hf_state_from_model",
    "initialize_parallel",
    "load_hf_checkpoint",
    "load_hf_into_model",
    "model_chunks",
    "model_config_from_hf",
    "routing_replay",
    "save_hf_checkpoint",
    "stage_layer_indices",
    "stage_layers",
]
