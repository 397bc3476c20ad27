"""The one place that turns a `RolloutConfig` into a `RolloutEngine`: the trainer imports no concrete engine."""

from __future__ import annotations

from pathlib import Path

from megatron_pdm.models.config import ModelConfig
from megatron_pdm.precision import rollout_engine_dtype

from .base import RolloutEngine
from .config import RolloutConfig


def build_engine(rollout_cfg: RolloutConfig, model_cfg: ModelConfig, precision_cfg, *, run_dir,
                 tokenizer_dir=None) -> RolloutEngine:
    """The engine `rollout_cfg` asks for, not started (call `start()`):

    - engine "embedded": an in-process `EmbeddedEngine` computing in the rollout dtype of `precision_cfg.rollout`
      (fp8: bf16 compute on block-FP8-rounded weights);
    - engine "sglang": an `SGLangEngine` attached to `rollout_cfg.urls`, or launching `num_engines` servers
      (`server` sglang or megatron-pdm) from the first weights, logging under <run_dir>/logs and exporting weights
      under `weight_dir` (default <run_dir>/weights). FP8 engines start from, and are sent, block-FP8 weights.

    tokenizer_dir: copied beside every disk export (engines start with the trainer's tokenizer, and stop at its EOS
    ids too); the embedded engine stops at the same ids, as an SGLang engine on such an export does."""
    dtype, quantization = rollout_engine_dtype(precision_cfg.rollout)
    if rollout_cfg.engine == "sglang":
        return _sglang(rollout_cfg, model_cfg, precision_cfg, dtype, quantization, Path(run_dir), tokenizer_dir)
    from .embedded import EmbeddedEngine

    return EmbeddedEngine(model_cfg, dtype=dtype, quantization=quantization, eos_token_ids=_eos_ids(tokenizer_dir))


def _eos_ids(tokenizer_dir) -> tuple[int, ...]:
    """The EOS ids an SGLang engine stops at when its checkpoint carries the tokenizer files of `tokenizer_dir` (the
    trainer's exports do): none without a tokenizer."""
    if tokenizer_dir is None:
        return ()
    from megatron_pdm.models.tokenizer import load_tokenizer

    from .sglang.wire import checkpoint_eos_ids

    return checkpoint_eos_ids(tokenizer_dir, load_tokenizer(tokenizer_dir).stop_ids)


def _sglang(r: RolloutConfig, model_cfg, precision_cfg, dtype: str, quantization: str | None, run_dir: Path,
            tokenizer_dir):
    from .sglang.client import SGLangEngine

    if not r.urls and not r.num_engines:
        raise ValueError("rollout.urls / rollout.num_engines: the sglang engine needs worker URLs or a number of "
                         "engines to launch (megatron-pdm submit fills in the URLs of those it starts)")
    if r.num_engines and r.server == "sglang" and r.weight_sync == "distributed":
        import torch

        if torch.cuda.is_available():  # engine 0 starts at GPU 0 (--base-gpu-id), where rank 0 trains
            raise ValueError("rollout.weight_sync: 'distributed' with engines launched on the trainer's GPUs "
                             "(rollout.num_engines): engine 0's first rank shares GPU 0 with the trainer's rank 0, "
                             "and one NCCL group cannot hold both; use 'tensor' or 'disk'")
    launch = r.launch_spec(dtype=dtype, kv_cache_dtype=precision_cfg.kv_cache, run_dir=run_dir)
    # one bucket size (rollout.sync_bucket_bytes): the trainer's buckets, sent as they come
    return SGLangEngine(r, model_cfg, weight_dir=r.export_dir(run_dir), launch=launch, quantization=quantization,
                        dtype=dtype, tokenizer_dir=tokenizer_dir)
