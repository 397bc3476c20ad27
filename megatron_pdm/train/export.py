"""`megatron-pdm export CHECKPOINT --to DIR`: a distributed checkpoint as an HF checkpoint (safetensors shards,
model.safetensors.index.json, config.json, the tokenizer files) that transformers and SGLang load.

It runs in one process whatever layout wrote the checkpoint: the model is built at TP = PP = EP = 1 in the
training dtype, dist_checkpointing reshards the saved shards into it, and the HF tensors are written one bucket
at a time; a DeepSeek-V3's multi-token-prediction layers, which RL does not train, come unchanged from the HF
checkpoint the run started from. Memory: the model once, plus one bucket.
"""

from __future__ import annotations

import itertools
import pickle
from dataclasses import replace
from pathlib import Path

import yaml

from megatron_pdm._overwrite import deletion_problem, remove
from megatron_pdm.models import ParallelConfig, build_model, initialize_parallel, save_hf_checkpoint
from megatron_pdm.models.hf import DEFAULT_BUCKET_BYTES, hf_buckets_from_model, load_hf_checkpoint, mtp_keys
from megatron_pdm.precision import megatron_model_settings

from .checkpoint import (
    CONFIG_FILE,
    TOKENIZER_DIR,
    check_pickles,
    checkpoint_problem,
    model_mismatches,
    sharded_state,
)
from .config import Config, config_from_dict

# user code a run's config may name, which loading the config imports (and runs): only the training job may
_USER_CODE = {"data": ("reward",), "rollout": ("tool_fn", "generate_fn")}


def _without_user_code(d: dict) -> dict:
    """`d` without the fields naming user code (their built-in defaults instead); rollout.max_turns back to 1, since
    more turns without a tool_fn / generate_fn is itself an error."""
    d = dict(d)
    for section, fields in _USER_CODE.items():
        if isinstance(d.get(section), dict):
            d[section] = {k: v for k, v in d[section].items() if k not in fields}
    if isinstance(d.get("rollout"), dict) and "max_turns" in d["rollout"]:
        d["rollout"] = {**d["rollout"], "max_turns": 1}
    return d


def run_config(checkpoint) -> Config:
    """The config a checkpoint was written with (its config.yaml), for rebuilding its model. Loaded without the
    run's user code: `data.reward`, `rollout.tool_fn` and `rollout.generate_fn` may name a user module
    (`my_pkg.rewards:score`, `tools.py:reply`) that only the training job could import, and loading the config
    would import it (and run it); an export computes no reward and generates nothing."""
    path = Path(checkpoint) / CONFIG_FILE
    try:
        d = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: must hold a mapping of sections")
    d = _without_user_code(d)
    try:
        return config_from_dict(d)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _out_problem(checkpoint: Path, out: Path) -> str | None:
    """Why writing (and with --force, first deleting) `out` would destroy the checkpoint's run or more
    (`deletion_problem`: `out` is or contains the run directory, <run-dir>/checkpoints/step_N's grandparent, the
    current or home directory), or lies in its checkpoints directory. Symlinks resolved."""
    ckpt, target = checkpoint.resolve(), out.resolve()
    checkpoints, run_dir = ckpt.parent, ckpt.parent.parent
    why = deletion_problem(f"--to {out}", out, [(f"the run directory {run_dir} of the checkpoint {checkpoint}",
                                                 run_dir)])
    if why is not None:
        return why
    if target == checkpoints or checkpoints in target.parents:
        return (f"--to {out}: is inside the checkpoints directory {checkpoints} of the checkpoint {checkpoint}; "
                "exporting there would replace the run's checkpoints: choose a directory outside it")
    return None


def check_export(checkpoint, out, *, force: bool) -> Config:
    """Every input error before a process starts: the checkpoint must be complete and its config load, the target
    must be new (or --force) and never the run's own directory or checkpoints. Returns the run's config."""
    checkpoint, out = Path(checkpoint), Path(out)
    why = checkpoint_problem(checkpoint)
    if why is not None:
        raise ValueError(f"{checkpoint}: not a complete checkpoint: {why}")
    why = _out_problem(checkpoint, out)
    if why is not None:  # before the exists check, whose message suggests --force
        raise ValueError(why)
    if out.exists() and not force:
        raise FileExistsError(f"--to {out}: exists; pass --force to replace it")
    return run_config(checkpoint)


def _frozen_mtp(cfg: Config, dtype, bucket_bytes: int):
    """The run's multi-token-prediction layers (model.mtp_num_layers > 0: not trained, not in the training
    checkpoint), read tensor by tensor from the HF checkpoint it started from, as more buckets of at most
    `bucket_bytes`. ValueError, before anything is written, when that checkpoint is gone or lacks them: an export
    whose config.json promises MTP layers it lacks would break an engine's speculative decoding."""
    if not cfg.model.mtp_num_layers:
        return iter(())
    if cfg.train.init != "hf":
        raise ValueError(f"model.mtp_num_layers: {cfg.model.mtp_num_layers} MTP layers, but the run started from "
                         f"train.init {cfg.train.init!r}, not an HF checkpoint holding them")
    try:
        state, _ = load_hf_checkpoint(cfg.train.init_path)
    except FileNotFoundError as e:
        raise ValueError(f"model.mtp_num_layers: {cfg.model.mtp_num_layers} MTP layers are carried from "
                         f"train.init_path, which is unreadable: {e}") from None
    keys = mtp_keys(state, cfg.model)
    if not keys:
        raise ValueError(f"model.mtp_num_layers: {cfg.model.mtp_num_layers}, but train.init_path "
                         f"{cfg.train.init_path} holds no model.layers.{cfg.model.num_layers}.* tensors")

    def buckets():
        bucket, size = {}, 0
        for k in keys:
            t = state[k].to(dtype)
            if bucket and size + t.numel() * t.element_size() > bucket_bytes:
                yield bucket
                bucket, size = {}, 0
            bucket[k] = t
            size += t.numel() * t.element_size()
        if bucket:
            yield bucket

    return buckets()


def export_job(checkpoint, out, force: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Path:
    """Run in a world of one process (torch.distributed initialised)."""
    from megatron.core import dist_checkpointing

    checkpoint, out = Path(checkpoint), Path(out)
    cfg = check_export(checkpoint, out, force=force)
    try:
        check_pickles(checkpoint)  # nothing in a checkpoint runs code, an export's neither
    except pickle.UnpicklingError as e:
        raise ValueError(f"{checkpoint}: refused: {e}") from None
    with initialize_parallel(ParallelConfig(), seed=cfg.train.seed) as single:
        model = build_model(cfg.model, single, **megatron_model_settings(cfg.precision))
        mismatches = model_mismatches(checkpoint, model)
        if mismatches:
            raise ValueError(f"{checkpoint}: does not match its own config.yaml: {mismatches[0]}")
        model.load_state_dict(dist_checkpointing.load(sharded_state(model, None, is_loading=True),
                                                      str(checkpoint))["model"])
        remove(out)  # --force (check_export refused it otherwise)
        dtype = next(model.parameters()).dtype
        buckets = hf_buckets_from_model(model, cfg.model, single, bucket_bytes=bucket_bytes, dtype=dtype)
        save_hf_checkpoint(out, itertools.chain(buckets, _frozen_mtp(cfg, dtype, bucket_bytes)),
                           replace(cfg.model, tokenizer=None), tokenizer_dir=checkpoint / TOKENIZER_DIR)
    return out
