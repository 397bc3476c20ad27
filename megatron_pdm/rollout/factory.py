"""The one place that turns a `RolloutConfig` into a `RolloutEngine`: the trainer imports no concrete engine."""

from __future__ import annotations

from pathlib import Path

from megatron_pdm.models.config import ModelConfig
from megatron_pdm.precision import rollout_engine_dtype

from .base import RolloutEngine
from .config import RolloutConfig
from .engines import engine_spec


def build_engine(rollout_cfg: RolloutConfig, model_cfg: ModelConfig, precision_cfg, *, run_dir,
                 tokenizer_dir=None) -> RolloutEngine:
    """The engine `rollout_cfg.engine` names (its spec's `build`, engines.py), not started (call `start()`), in the
    rollout dtype and quantization of `precision_cfg.rollout`.

    tokenizer_dir: copied beside every disk export (engines start with the trainer's tokenizer, and stop at its EOS
    ids too); the embedded engine stops at the same ids, as an SGLang engine on such an export does."""
    dtype, quantization = rollout_engine_dtype(precision_cfg.rollout)
    return engine_spec(rollout_cfg.engine).build(rollout_cfg, model_cfg, precision_cfg, dtype=dtype,
                                                 quantization=quantization, run_dir=Path(run_dir),
                                                 tokenizer_dir=tokenizer_dir)
