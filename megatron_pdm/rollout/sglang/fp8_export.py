"""A block-FP8 copy of an HF checkpoint, for SGLang FP8 engines:
`python -m megatron_pdm.rollout.sglang.fp8_export SRC DST`.

SGLang's FP8 load rules live here (`is_block_fp8`, `engine_quantization`). SGLang serves a checkpoint whose
config.json carries a block-FP8 `quantization_config` (DeepSeek-V3 / Qwen3-FP8
layout: each linear weight as float8_e4m3fn beside `<name>_scale_inv`, one scale per 128 x 128 block) as FP8
without --quantization, and such an engine takes the trainer's block-FP8 weight updates. An engine that
quantizes a bf16 checkpoint itself (--quantization fp8) cannot: so the Slurm script starts its FP8 engines from
this export. A checkpoint that is block-FP8 already (DeepSeek-V3's own weights) is linked, not copied. Shards
are converted one at a time (memory: one shard); the config is written last, so a copy that was interrupted is
redone and a complete one is kept (a requeued job does not convert again).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from megatron_pdm.models.hf import HF_INDEX as INDEX
from megatron_pdm.models.hf import checkpoint_files
from megatron_pdm.precision import FP8_BLOCK, FP8_QUANTIZATION_CONFIG, FP8_SCALE_SUFFIX, fp8_block_state


def is_block_fp8(quantization_config: dict | None) -> bool:
    """Whether a checkpoint's `quantization_config` is block-FP8 [128, 128]: the one test of it (the trainer's view of
    an attached engine, `serve`'s of the checkpoints it loads, this export)."""
    q = quantization_config or {}
    return q.get("quant_method") == "fp8" and list(q.get("weight_block_size") or []) == [FP8_BLOCK, FP8_BLOCK]


def engine_quantization(url: str, flag: str | None, model_path, config: dict | None) -> str | None:
    """What weights the SGLang engine at `url` takes: "fp8" (block-FP8) or None (its dtype), from its --quantization
    flag (/server_info `quantization`) and its checkpoint's config.json (`config`, None when the trainer cannot
    read it: SGLang serves a block-FP8 checkpoint as FP8 without the flag). ValueError when it cannot be known or
    takes no weight updates."""
    where = f"rollout.sglang.urls: {url} (model {model_path!r}, --quantization {flag})"
    if config is None:
        raise ValueError(f"{where}: cannot tell whether the engine is quantized: its checkpoint's config.json is not "
                         "readable from the trainer (SGLang serves a block-FP8 checkpoint as FP8 without "
                         "--quantization); give the engines a model path the trainer can read")
    quant = config.get("quantization_config")
    if is_block_fp8(quant):
        return "fp8"
    if quant:
        raise ValueError(f"{where}: checkpoint quantization_config {quant} is not block-FP8 [128, 128], the only "
                         "quantized weights the trainer sends")
    if flag == "fp8":
        raise ValueError(f"{where}: the engine quantizes a bf16 checkpoint to FP8 itself, and SGLang refuses weight "
                         "updates into such an engine; start it from a block-FP8 checkpoint without --quantization "
                         "(python -m megatron_pdm.rollout.sglang.fp8_export SRC DST)")
    if flag:
        raise ValueError(f"{where}: quantization {flag!r} is not supported (none, or block-FP8 checkpoints)")
    return None


def export_block_fp8(src, dst) -> Path:
    """Write (or link, when SRC is block-FP8 already) the block-FP8 checkpoint of SRC at DST; returns DST. SRC's
    tensors are those `checkpoint_files` says (its index's files, checked before anything is written)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    files = checkpoint_files(src)
    if is_block_fp8(config.get("quantization_config")):
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(src.resolve(), dst)
        return dst
    if config.get("quantization_config"):
        raise ValueError(f"{src}: config.json quantization_config {config['quantization_config']} is not bf16/fp32 "
                         f"weights nor block-FP8 [{FP8_BLOCK}, {FP8_BLOCK}]")
    if (dst / "config.json").is_file() and is_block_fp8(json.loads((dst / "config.json").read_text())
                                                        .get("quantization_config")):
        return dst  # done before (a requeued job)
    dst.mkdir(parents=True, exist_ok=True)
    shards = {}  # file -> its keys, in the checkpoint's order
    for key, path in files.items():
        shards.setdefault(path, []).append(key)
    weight_map = {}
    for shard, keys in sorted(shards.items()):
        with safe_open(str(shard), "pt") as handle:
            state = fp8_block_state({k: handle.get_tensor(k) for k in keys})
        tmp = dst / (shard.name + ".tmp")
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
        tmp.replace(dst / shard.name)
        weight_map.update(dict.fromkeys(state, shard.name))
    if (src / INDEX).is_file() or len(shards) > 1:
        index = json.loads((src / INDEX).read_text()) if (src / INDEX).is_file() else {"metadata": {}}
        index["weight_map"] = weight_map
        (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    for f in src.iterdir():  # tokenizer files, generation config, remote code: everything but weights and config
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (INDEX, "config.json"):
            shutil.copyfile(f, dst / f.name)
    scales = sum(k.endswith(FP8_SCALE_SUFFIX) for k in weight_map)
    config["quantization_config"] = FP8_QUANTIZATION_CONFIG
    tmp = dst / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(dst / "config.json")
    print(f"fp8_export: {src} -> {dst}: {scales} block-FP8 weights", flush=True)
    return dst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="HF checkpoint directory (bf16 / fp32, or block-FP8 already)")
    ap.add_argument("dst", help="where the block-FP8 checkpoint goes")
    args = ap.parse_args(argv)
    try:
        export_block_fp8(args.src, args.dst)
    except (ValueError, FileNotFoundError) as e:
        print(f"fp8_export: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
