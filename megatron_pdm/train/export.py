"""`megatron-pdm export CHECKPOINT --to DIR`: a distributed checkpoint as an HF checkpoint (safetensors shards,
model.safetensors.index.json, config.json, the tokenizer files) that transformers and SGLang load.

It runs in one process whatever layout wrote the checkpoint: the model is built at TP = PP = EP = 1 in the
training dtype, dist_checkpointing reshards the saved shards into it, and the HF tensors are written one bucket
at a time. Memory: the model once, plus one bucket.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import yaml

from megatron_pdm.models import ParallelConfig, build_model, destroy_parallel, initialize_parallel, save_hf_checkpoint
from megatron_pdm.models.hf import DEFAULT_BUCKET_BYTES, hf_buckets_from_model
from megatron_pdm.precision import megatron_model_settings

from .checkpoint import CONFIG_FILE, TOKENIZER_DIR, checkpoint_problem, model_mismatches, sharded_state
from .config import config_from_dict


def check_export(checkpoint, out, *, force: bool) -> None:
    """Every input error before a process starts: the checkpoint must be complete, the target new (or --force)."""
    checkpoint, out = Path(checkpoint), Path(out)
    why = checkpoint_problem(checkpoint)
    if why is not None:
        raise ValueError(f"{checkpoint}: not a complete checkpoint: {why}")
    if out.exists() and not force:
        raise FileExistsError(f"--to {out}: exists; pass --force to replace it")


def export_job(checkpoint, out, force: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Path:
    """Run in a world of one process (torch.distributed initialised)."""
    from megatron.core import dist_checkpointing

    checkpoint, out = Path(checkpoint), Path(out)
    check_export(checkpoint, out, force=force)
    cfg = config_from_dict(yaml.safe_load((checkpoint / CONFIG_FILE).read_text()))
    single = ParallelConfig()
    initialize_parallel(single, seed=cfg.train.seed)
    try:
        model = build_model(cfg.model, single, **megatron_model_settings(cfg.precision))
        mismatches = model_mismatches(checkpoint, model)
        if mismatches:
            raise ValueError(f"{checkpoint}: does not match its own config.yaml: {mismatches[0]}")
        model.load_state_dict(dist_checkpointing.load(sharded_state(model, None, is_loading=True),
                                                      str(checkpoint))["model"])
        if out.exists():
            shutil.rmtree(out)
        dtype = next(model.parameters()).dtype
        save_hf_checkpoint(out, hf_buckets_from_model(model, cfg.model, bucket_bytes=bucket_bytes, dtype=dtype),
                           replace(cfg.model, tokenizer=None), tokenizer_dir=checkpoint / TOKENIZER_DIR)
    finally:
        destroy_parallel()
    return out
