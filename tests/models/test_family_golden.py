"""Pins what every model family's tensor list feeds (issue 55): the HF tensors the converter exports (names,
shapes) and the megatron rows it maps them from, the weight sync's per-item element counts, the FP8-quantized
tensors, and the planner's parameter counts of every preset in examples/presets. The golden file was written by
the code before the families moved into one home each; regenerate it only for an intended change:
`PYTHONPATH=. python -m tests.models.test_family_golden` (then review the diff)."""

import dataclasses
import json
import re
from pathlib import Path

import torch

from megatron_pdm.cluster.plan import count_parameters
from megatron_pdm.models import ModelConfig, ParallelConfig, build_model, hf_state_from_model, initialize_parallel
from megatron_pdm.models.hf.mapping import _mapping
from megatron_pdm.precision import fp8_quantizable
from megatron_pdm.train.config import load_config
from megatron_pdm.train.weight_sync import _hf_numels
from tests.helpers import DENSE, MOE
from tests.models.test_model_families import DSV3, KIMI, LLAMA, QWEN2

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "family_golden.json"
FAMILIES = {
    "qwen3": DENSE,
    "qwen3_untied": ModelConfig(**{**DENSE.__dict__, "tie_word_embeddings": False}),
    "qwen3_moe": MOE,
    "qwen2": QWEN2,
    "llama": LLAMA,
    "deepseek_v3": DSV3,
    "kimi_k2": KIMI,
}


def rank_exported_shapes(group, cfg):
    """{HF name: shape} that one process's export of `cfg` produces, in export order."""
    ctx = initialize_parallel(ParallelConfig())
    model = build_model(cfg, ctx)
    shapes = {k: list(v.shape) for k, v in hf_state_from_model(model, cfg, ctx).items()}
    ctx.close()
    return shapes


def family_record(cfg: ModelConfig, shapes: dict) -> dict:
    L = cfg.num_layers
    rows = _mapping(cfg, range(L), first=True, last=True)
    ep = 2 if cfg.num_experts else 1
    return {
        "hf_shapes": shapes,
        "rows": [[m, hf, kind] for m, hf, kind in rows],
        "sync_numels": {"ep1": _hf_numels(cfg, list(range(L)), first=True, last=True, ep=1),
                        f"ep{ep}_middle": _hf_numels(cfg, list(range(L)), first=False, last=False, ep=ep)},
        "fp8_quantized": [k for k, s in shapes.items() if fp8_quantizable(k, torch.empty(s, device="meta"))],
        "parameters": dataclasses.asdict(count_parameters(cfg)),
    }


def preset_record(path: Path) -> dict:
    c = count_parameters(load_config(path).model)
    return {**dataclasses.asdict(c), "total": c.total, "active": c.active}


def current(pool) -> dict:
    out = {"families": {}, "presets": {}}
    for name, cfg in FAMILIES.items():
        (shapes,) = pool.run(rank_exported_shapes, shared=(cfg,))
        out["families"][name] = family_record(cfg, shapes)
    for path in sorted((ROOT / "examples" / "presets").glob("*.yaml")):
        out["presets"][path.stem] = preset_record(path)
    return out


def test_family_tensor_lists_match_the_golden_file(dist_pools):
    got = json.loads(json.dumps(current(dist_pools(1))))  # tuples -> lists, as the file holds them
    want = json.loads(GOLDEN.read_text())
    assert got["presets"] == want["presets"]
    for name in FAMILIES:
        assert got["families"][name] == want["families"][name], name
    assert got == want


if __name__ == "__main__":
    from tests.distributed import DistPool

    pool = DistPool(1)
    try:
        text = json.dumps(current(pool), indent=1)  # lists of numbers on one line each: a readable diff
        text = re.sub(r"\[\s*([\d,\s]*?)\s*\]", lambda m: "[" + re.sub(r",\s*", ", ", m[1]) + "]", text)
        GOLDEN.write_text(text + "\n")
    finally:
        pool.close()
