"""megatron-core models (the Qwen3, Qwen2, Llama and DeepSeek-V3 families), their Hugging Face checkpoint mapping,
and the parallel layout with its process groups (`ParallelContext`)."""

from .config import ModelConfig
from .gpt import (
    build_model,
    build_model_chunks,
    causal_mask,
    forward_logits,
    fuse_output_layer,
    is_output_fused,
    model_chunks,
    output_weight,
    routing_replay,
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
)
from .layout import Layout, layout_of, layout_problem
from .parallel import (
    ExportRoles,
    ParallelConfig,
    ParallelContext,
    destroy_parallel,
    initialize_parallel,
    pipeline_layer_counts,
    pipeline_layer_range,
    stage_layer_indices,
)

__all__ = [
    "ModelConfig",
    "ExportRoles",
    "ParallelConfig",
    "ParallelContext",
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
    "fuse_output_layer",
    "hf_buckets_from_model",
    "hf_config_dict",
    "hf_state_from_model",
    "initialize_parallel",
    "is_output_fused",
    "load_hf_checkpoint",
    "load_hf_into_model",
    "model_chunks",
    "model_config_from_hf",
    "output_weight",
    "routing_replay",
    "save_hf_checkpoint",
    "stage_layer_indices",
]
