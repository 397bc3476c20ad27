"""Hugging Face <-> Megatron checkpoints (no megatron-bridge): `config` (config.json <-> ModelConfig), `mapping`
(the tensor map, derived from each family's tensor list in `models.families`, and whole-state import / export),
`export` (bounded-memory bucketed export, block-FP8, writing checkpoints), `io` (reading checkpoints). The names
other modules use are re-exported here.

HF side: the canonical checkpoint layout that SGLang, vLLM and the Hub use (per-expert `mlp.experts.{e}.*`
keys), saved as `model.safetensors` + `config.json`. Megatron side: the `named_parameters()` of this rank's
`GPTModel` (local or TE spec), sharded over tensor parallelism and, for experts, over expert parallelism; with
virtual pipeline stages, of each of its model chunks (a list of GPTModels; every function here takes either).

Layout facts the mapping relies on:
- `linear_qkv` rows are grouped per query group g: [q of the g-th group's heads; k_g; v_g]; TP splits groups.
- `linear_fc1` of a SwiGLU MLP is [gate; up] *per TP shard*.
- Row-parallel weights (`linear_proj`, `linear_fc2`) split the input dimension; embeddings and the output
  layer split the vocabulary.
"""

from .config import HF_ARCHITECTURES, NOT_ARCHITECTURE, architecture_mismatches, hf_config_dict, model_config_from_hf
from .export import (
    DEFAULT_BUCKET_BYTES,
    finish_hf_checkpoint,
    hf_buckets_from_model,
    save_hf_checkpoint,
    save_hf_shards,
)
from .io import (
    HF_INDEX,
    HFCheckpointState,
    canonical_hf_state,
    checkpoint_files,
    is_mtp_key,
    load_hf_checkpoint,
    mtp_keys,
)
from .mapping import export_dtype, hf_state_from_model, load_hf_into_model, megatron_state_from_hf

__all__ = ["DEFAULT_BUCKET_BYTES", "HF_ARCHITECTURES", "HF_INDEX", "NOT_ARCHITECTURE", "HFCheckpointState",
           "architecture_mismatches", "canonical_hf_state", "checkpoint_files", "export_dtype", "finish_hf_checkpoint",
           "hf_buckets_from_model", "hf_config_dict", "hf_state_from_model", "is_mtp_key", "load_hf_checkpoint",
           "load_hf_into_model", "megatron_state_from_hf", "model_config_from_hf", "mtp_keys", "save_hf_checkpoint",
           "save_hf_shards"]
