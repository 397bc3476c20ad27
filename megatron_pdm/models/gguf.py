"""An ordinary HF checkpoint directory from a GGUF file (`megatron-pdm from-gguf`), so that every path (train,
analyze, serve, export) takes a model that ships as GGUF as it takes a downloaded one.

transformers reads the file (`from_pretrained(..., gguf_file=...)`, which needs the `gguf` package): the
architecture and sizes from its metadata, the tensors dequantized to float32 (llama's q / k rows permuted back from
llama.cpp's rotary layout), the tokenizer rebuilt from its vocabulary, merges and special tokens, the chat template
from `tokenizer.chat_template`. The directory gets `config.json`, `model.safetensors`, the tokenizer files and
`generation_config.json`. A quantized file (SmolLM2-135M-Instruct's Q4_1) yields the weights of the quantized
model in float32: its rounding stays in them; they are not the original checkpoint's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from megatron_pdm._overwrite import deletion_problem, remove


def _staging(out: Path) -> Path:
    """Where the checkpoint is written before it is renamed to `out` (a crashed conversion's is deleted)."""
    return out.parent / f".{out.name}.from-gguf"


def check_gguf_target(gguf_path, out, *, force: bool = False) -> tuple[Path, Path]:
    """(the GGUF file, the directory to write), or ValueError naming the argument: the file must exist and be
    GGUF (its magic); `out` must not exist unless `force`, and neither `out` nor its staging directory, which are
    deleted, may be or hold the file, the current directory or the home directory (`deletion_problem`)."""
    path, out = Path(gguf_path), Path(out)
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (its first bytes are not GGUF)")
    keep = [(f"the GGUF file {path}", path)]
    for label, target in ((f"--to {out}", out), (f"--to {out}'s staging directory {_staging(out)}", _staging(out))):
        why = deletion_problem(label, target, keep)
        if why is not None:  # before the exists check, whose message suggests --force
            raise ValueError(why)
    if out.exists() and not force:
        raise ValueError(f"--to {out} exists (--force replaces it)")
    return path, out


def _float32_decimals(value):
    """`value` (a config's JSON tree) with every float as the shortest decimal of its float32, as the original
    config.json spelled it: GGUF keeps metadata floats in float32, so rms_norm_eps 1e-5 comes back as
    9.99999974737875e-06 and would differ from a model section that says 1e-5."""
    import numpy as np

    if isinstance(value, dict):
        return {k: _float32_decimals(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_float32_decimals(v) for v in value]
    if isinstance(value, float) and np.isfinite(value):
        return float(str(np.float32(value)))  # str: the shortest decimal that reads back as this float32
    return value


def hf_checkpoint_from_gguf(gguf_path, out, *, force: bool = False) -> Path:
    """Write the HF checkpoint of `gguf_path` to `out` (`check_gguf_target`'s rules), atomically: written beside it
    under a temporary name, read back with `load_hf_checkpoint`, then renamed. An architecture the trainer cannot
    build is a ValueError naming it, and nothing is left at `out`. Memory: the model in float32, twice at most
    (transformers' dequantized tensors and the model)."""
    import torch
    import transformers

    from .hf import canonical_hf_state, load_hf_checkpoint, model_config_from_hf, save_hf_checkpoint

    path, out = check_gguf_target(gguf_path, out, force=force)
    tmp = _staging(out)
    remove(tmp)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32)
        # written by the trainer's own writer (transformers refuses to save a model it read from GGUF):
        # config.json from the ModelConfig, which refuses an architecture the trainer cannot build
        hf_config = _float32_decimals({k: v for k, v in model.config.to_dict().items() if k != "quantization_config"})
        cfg = model_config_from_hf(hf_config)
        state = canonical_hf_state(dict(model.state_dict()))
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # the embedding's own tensor
        tokenizer_dir = tmp / "tokenizer"
        tokenizer.save_pretrained(tokenizer_dir)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tokenizer_dir)
        del model
        save_hf_checkpoint(tmp, state, cfg, tokenizer_dir=tokenizer_dir)
        shutil.rmtree(tokenizer_dir)
        load_hf_checkpoint(tmp)  # reads back as every path reads a checkpoint
        remove(out)  # --force (check_gguf_target refused it otherwise)
        tmp.rename(out)
    finally:
        remove(tmp)
    return out
