"""Reading HF checkpoints: which file holds each tensor (`checkpoint_files`, the index), a lazy state over the
safetensors files (`HFCheckpointState`), `load_hf_checkpoint`, the MTP keys and the canonical key layout."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from megatron_pdm.precision import (
    FP8_SCALE_SUFFIX,
)

from ..config import ModelConfig
from .config import model_config_from_hf

log = logging.getLogger(__name__)


HF_INDEX = "model.safetensors.index.json"
# safetensors' names of the float8 dtypes: a tensor in one is raw codes until its block scales multiply it
FLOAT8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})


def _header_dtypes(path: Path) -> dict[str, str]:
    """key -> safetensors dtype name of every tensor in one file, from its header alone (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), "pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    return {k: handle.get_slice(k).get_dtype() for k in handle.keys()}  # noqa: SIM118 (a handle, not a dict)


def _index_weight_map(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's weight_map (HF key -> file name); ValueError naming the index for a file that
    is not one, or a tensor it names in two files (which one holds it is then unknown)."""
    def pairs(items):
        out = {}
        for k, v in items:
            if k in out and out[k] != v:
                raise ValueError(f"{index}: names {k} twice, in {out[k]} and {v}")
            out[k] = v
        return out

    try:
        weight_map = json.loads(index.read_text(), object_pairs_hook=pairs).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index ({e})") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(f, str) and f.endswith(".safetensors") and "/" not in f for f in weight_map.values()):
        raise ValueError(f"{index}: weight_map: expected {{tensor: file name}} of *.safetensors files beside it, "
                         f"got {str(weight_map)[:200]}")
    return weight_map


def _check_fp8_pairs(files: Mapping[str, Path], dtypes: Mapping[str, str]) -> None:
    """ValueError naming the tensor and its file for a float8 weight without its `_scale_inv` (it would load as raw
    e4m3 codes, thousands of times too large), and for scales without a float8 weight to multiply."""
    for key, dtype in dtypes.items():
        weight = key.removesuffix(FP8_SCALE_SUFFIX)
        if key == weight and dtype in FLOAT8_DTYPES and key + FP8_SCALE_SUFFIX not in dtypes:
            raise ValueError(f"{key} ({files[key]}): a {dtype} weight without its block-FP8 scales "
                             f"{key}{FP8_SCALE_SUFFIX} in the checkpoint")
        if key != weight and weight not in dtypes:
            raise ValueError(f"{key} ({files[key]}): block-FP8 scales without their weight")
        if key != weight and dtypes[weight] not in FLOAT8_DTYPES:
            raise ValueError(f"{key} ({files[key]}): block-FP8 scales beside {weight} ({files[weight]}), which is "
                             f"{dtypes[weight]}, not float8")


def checkpoint_files(directory) -> dict[str, Path]:
    """HF key -> the file that holds it, for the HF checkpoint in `directory`: the one reader of which files a
    checkpoint's tensors come from (`load_hf_checkpoint`, `rollout.fp8_export`). With model.safetensors.index.json,
    exactly the tensors its weight_map names, each from the file it names; a *.safetensors file beside it that it
    does not name, and a tensor that a named file holds beside its own, are not read (a leftover file never
    overrides a tensor) and are logged. Without an index, every *.safetensors file's tensors, a tensor held by two
    files refused (which one is meant is unknown).

    Refused before any tensor is read (headers only, a few bytes a tensor), naming the tensor and the file: a file
    the index names that is missing or lacks the tensor (FileNotFoundError / ValueError), a float8 weight without its
    block-FP8 scales or scales without a float8 weight (`_check_fp8_pairs`)."""
    directory = Path(directory)
    on_disk = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    index = directory / HF_INDEX
    if not index.is_file():
        if not on_disk:
            raise FileNotFoundError(f"{directory}: no *.safetensors files")
        files, dtypes = {}, {}
        for path in on_disk:
            for key, dtype in _header_dtypes(path).items():
                if key in files:
                    raise ValueError(f"{key}: held by both {files[key]} and {path}, and no {HF_INDEX} says which "
                                     "is the checkpoint's")
                files[key], dtypes[key] = path, dtype
        _check_fp8_pairs(files, dtypes)
        return files
    weight_map = _index_weight_map(index)
    headers = {}
    for key, name in weight_map.items():
        if name not in headers:
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory / name}: missing, though {HF_INDEX} names it for {key}")
            headers[name] = _header_dtypes(directory / name)
        if key not in headers[name]:
            raise ValueError(f"{key}: {HF_INDEX} names {directory / name} for it, which does not hold it")
    unread = [p.name for p in on_disk if p.name not in headers]
    unread += [f"{k} in {name}" for name, dtypes in headers.items() for k in dtypes if weight_map.get(k) != name]
    if unread:
        log.warning("%s: %s does not name these, which are not read: %s%s", directory, HF_INDEX,
                    ", ".join(unread[:4]), f" and {len(unread) - 4} more" if len(unread) > 4 else "")
    files = {k: directory / name for k, name in weight_map.items()}
    _check_fp8_pairs(files, {k: headers[name][k] for k, name in weight_map.items()})
    return files


class HFCheckpointState(Mapping):
    """The tensors of an HF checkpoint (`checkpoint_files`: key -> its file), each read when it is asked for
    (memory-mapped, one tensor at a time), a block-FP8 weight (float8_e4m3fn q with its `_scale_inv` block scales, as
    DeepSeek-V3 and Kimi-K2 are released) dequantized to float32 as it is read. A rank that loads its shards reads
    the full tensors of its own layers only: never the whole model in memory (a 671B checkpoint is 1.3 TB in
    float32)."""

    def __init__(self, files: Mapping[str, Path]):
        from safetensors import safe_open

        # key -> the open (memory-mapped) file holding it, each file opened once; the scales may sit in another
        # shard than their weight
        handles = {path: safe_open(str(path), "pt") for path in set(files.values())}
        self._file, self._scales = {}, {}
        for key, path in files.items():
            (self._scales if key.endswith(FP8_SCALE_SUFFIX) else self._file)[key] = handles[path]

    def __getitem__(self, key: str) -> torch.Tensor:
        from megatron_pdm.precision import fp8_block_dequantize

        t = self._file[key].get_tensor(key)
        scale = key + FP8_SCALE_SUFFIX
        if scale in self._scales:
            return fp8_block_dequantize(t, self._scales[scale].get_tensor(scale), torch.float32)
        return t

    def __contains__(self, key) -> bool:  # Mapping's default would read the tensor
        return key in self._file

    def __iter__(self):
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)


def is_mtp_key(key: str, cfg: ModelConfig) -> bool:
    """Whether an HF key is a multi-token-prediction layer's (`model.layers.{i}.*` for i >= num_layers; DeepSeek-V3's
    `model.layers.61.*`): a layer beside the main model, which neither RL nor an engine's main model uses (SGLang's
    DeepseekV3ForCausalLM skips it too)."""
    layer = key.removeprefix("model.layers.").split(".", 1)[0]
    return key.startswith("model.layers.") and layer.isdigit() and int(layer) >= cfg.num_layers


def mtp_keys(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> list[str]:
    """The multi-token-prediction layers' keys of a DeepSeek-V3 checkpoint (`is_mtp_key`), which RL does not train:
    carried unchanged into exports, so that an engine serving the export can still decode speculatively with
    them."""
    return [k for k in state if is_mtp_key(k, cfg)]


def load_hf_checkpoint(directory) -> tuple[HFCheckpointState, ModelConfig]:
    """(state, config) of an HF checkpoint directory; the state reads each tensor when asked for it
    (`HFCheckpointState`) from the file `checkpoint_files` says holds it, a block-FP8 one dequantized to float32."""
    directory = Path(directory)
    config = directory / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config}: no config.json in the HF checkpoint directory")
    files = checkpoint_files(directory)
    cfg = model_config_from_hf(json.loads(config.read_text()))
    return HFCheckpointState(files), cfg


def canonical_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint keys from transformers>=5's fused in-memory MoE layout
    (`mlp.experts.gate_up_proj` [E, 2I, H] = [gate; up] per expert, `mlp.experts.down_proj` [E, H, I])."""
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            prefix = k[: -len("gate_up_proj")]
            for e, w in enumerate(v):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = w.chunk(2, dim=0)
        elif k.endswith("mlp.experts.down_proj"):
            prefix = k[: -len("down_proj")]
            for e, w in enumerate(v):
                out[f"{prefix}{e}.down_proj.weight"] = w
        else:
            out[k] = v
    return {k: v.contiguous() for k, v in out.items()}
