"""Which files an HF checkpoint's tensors come from (models/hf/io.py `checkpoint_files`, read by `load_hf_checkpoint`
and `rollout.fp8_export`): the index names them, a float8 weight comes with its block scales or the checkpoint is
refused, a leftover file never overrides a tensor; and engines (the embedded one, `serve`) load a DeepSeek-V3
checkpoint that carries its multi-token-prediction layer, skipping it as SGLang's main model does."""

import importlib.util
import json
import logging
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_pdm.models import canonical_hf_state, load_hf_checkpoint, save_hf_checkpoint
from megatron_pdm.models.hf import HF_INDEX
from megatron_pdm.precision import FP8_SCALE_SUFFIX, fp8_block_state
from tests.helpers import DENSE as FP8
from tests.helpers import ROOT, _in_process_server, hf_model

WEIGHT = "model.layers.0.mlp.down_proj.weight"


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    return canonical_hf_state(hf_model(FP8, seed=seed).state_dict())


def _fp8_sharded(directory, seed: int = 0):
    """A block-FP8 checkpoint in two shards with an index: every float8 q (and the rest) in model-00001, every
    `_scale_inv` in model-00002, as a sharded release may split them. Returns the full float32 state."""
    state = _state(seed)
    quantized = fp8_block_state(state)
    scales = {k: v for k, v in quantized.items() if k.endswith(FP8_SCALE_SUFFIX)}
    rest = {k: v for k, v in quantized.items() if k not in scales}
    save_hf_checkpoint(directory, iter([rest, scales]), FP8, fp8_blocks=True)
    assert json.loads((directory / HF_INDEX).read_text())["weight_map"][WEIGHT + FP8_SCALE_SUFFIX] == \
        "model-00002.safetensors"
    return state


def test_a_block_fp8_checkpoint_missing_its_scales_shard_is_refused_naming_the_tensor_and_file(tmp_path):
    """The scales' shard deleted: with the index, FileNotFoundError naming the file and a tensor it holds; with the
    index gone too, ValueError naming a float8 weight without its scales and its file (before: the float8 codes
    loaded as the weights, thousands of times too large). The FP8 export refuses it as well."""
    from megatron_pdm.rollout.sglang.fp8_export import export_block_fp8

    _fp8_sharded(tmp_path / "ck")
    (tmp_path / "ck" / "model-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002\.safetensors: missing, though .* names it for "
                                                r"model\.layers\.\d\..*_scale_inv"):
        load_hf_checkpoint(tmp_path / "ck")
    with pytest.raises(FileNotFoundError, match="model-00002.safetensors"):
        export_block_fp8(tmp_path / "ck", tmp_path / "fp8")
    assert not (tmp_path / "fp8").exists()
    (tmp_path / "ck" / HF_INDEX).unlink()
    with pytest.raises(ValueError, match=r"model\.layers\.\d\.\S+weight \(\S+model-00001\.safetensors\): a F8_E4M3 "
                                         r"weight without its block-FP8 scales \S+weight_scale_inv"):
        load_hf_checkpoint(tmp_path / "ck")


def test_block_fp8_scales_beside_a_plain_weight_are_refused(tmp_path):
    """Scales whose weight is float32 (it would be multiplied by them): refused, naming both and the file."""
    state = _state()
    save_hf_checkpoint(tmp_path, {**state, WEIGHT + FP8_SCALE_SUFFIX: torch.ones(1, 1)}, FP8)
    with pytest.raises(ValueError, match=rf"{WEIGHT}{FP8_SCALE_SUFFIX} \(\S+model.safetensors\): block-FP8 scales "
                                         rf"beside {WEIGHT} .* which is F32, not float8"):
        load_hf_checkpoint(tmp_path)


def test_only_the_tensors_the_index_names_are_read_and_the_rest_is_reported(tmp_path, caplog):
    """A *.safetensors file beside the index that it does not name, and a tensor a named shard holds that the index
    gives to another shard, both with other values: not read (the index's tensors load, bit for bit) and logged
    (before: every *.safetensors file was read, the last in name order winning). The FP8 export converts the
    index's tensors only, into the index's files."""
    from megatron_pdm.rollout.sglang.fp8_export import export_block_fp8

    state = _state()
    keys = sorted(state)
    save_hf_checkpoint(tmp_path / "ck", iter([{k: state[k] for k in keys[:5]}, {k: state[k] for k in keys[5:]}]), FP8)
    ck = tmp_path / "ck"
    save_file({keys[-1]: torch.zeros_like(state[keys[-1]])}, str(ck / "model-extra.safetensors"))
    first = load_file(str(ck / "model-00001.safetensors"))
    save_file({**first, keys[6]: torch.zeros_like(state[keys[6]])}, str(ck / "model-00001.safetensors"))
    with caplog.at_level(logging.WARNING, logger="megatron_pdm.models.hf"):
        loaded, _ = load_hf_checkpoint(ck)
    assert sorted(loaded) == keys and all(torch.equal(loaded[k], state[k]) for k in keys)
    assert "model-extra.safetensors" in caplog.text and f"{keys[6]} in model-00001.safetensors" in caplog.text
    out = export_block_fp8(ck, tmp_path / "fp8")
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model-00001.safetensors", "model-00002.safetensors"]
    clean = tmp_path / "clean"
    save_hf_checkpoint(clean, state, FP8)
    exported, reference = load_hf_checkpoint(out)[0], load_hf_checkpoint(export_block_fp8(clean, tmp_path / "c8"))[0]
    assert sorted(exported) == keys and all(torch.equal(exported[k], reference[k]) for k in keys)


def test_a_tensor_in_two_files_with_nothing_to_say_which_is_refused(tmp_path):
    """An index naming a tensor in two files, or two shards holding one tensor without an index: ValueError naming
    the tensor and both files (before: the last one read won)."""
    state = _state()
    keys = sorted(state)
    save_hf_checkpoint(tmp_path, iter([{k: state[k] for k in keys[:5]}, {k: state[k] for k in keys[5:]}]), FP8)
    index = (tmp_path / HF_INDEX).read_text()
    twice = index.replace('"weight_map": {', f'"weight_map": {{\n    "{keys[6]}": "model-00001.safetensors",', 1)
    (tmp_path / HF_INDEX).write_text(twice)
    with pytest.raises(ValueError, match=rf"names {keys[6]} twice, in model-00001.safetensors and "
                                         r"model-00002.safetensors"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / HF_INDEX).unlink()
    first = load_file(str(tmp_path / "model-00001.safetensors"))
    save_file({**first, keys[6]: state[keys[6]]}, str(tmp_path / "model-00001.safetensors"))
    with pytest.raises(ValueError, match=rf"{keys[6]}: held by both \S+model-00001.safetensors and "
                                         r"\S+model-00002.safetensors, and no model.safetensors.index.json"):
        load_hf_checkpoint(tmp_path)


# -- multi-token-prediction layers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example():
    """examples/tiny_deepseek_v3.py, whose checkpoint (block-FP8, one MTP layer `model.layers.3.*`) is the
    release's layout."""
    spec = importlib.util.spec_from_file_location("tiny_deepseek_v3", ROOT / "examples" / "tiny_deepseek_v3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_embedded_engine_skips_mtp_layers_in_a_state_and_a_stream(example):
    """A DeepSeek-V3 state with its MTP layer loads into the embedded engine, whole or as a stream of buckets
    (before: "unexpected ... model.layers.3.eh_proj.weight"); an unknown key is still refused."""
    from megatron_pdm.rollout.embedded import EmbeddedEngine

    cfg = example.tiny_deepseek_v3_config()
    state = canonical_hf_state(hf_model(cfg, seed=1).state_dict())
    mtp = example.mtp_layer(cfg, torch.Generator().manual_seed(1))
    engine = EmbeddedEngine(cfg)
    engine.update_weights(state | mtp, version=1)
    assert torch.equal(engine.model.state_dict()["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
    engine.update_weights(iter([dict(list(state.items())[:7]) | mtp, dict(list(state.items())[7:])]), version=2)
    assert engine.weight_version == 2
    with pytest.raises(ValueError, match="unexpected or repeated .'model.layers.0.extra.weight'"):
        engine.update_weights(state | {"model.layers.0.extra.weight": torch.ones(1)}, version=3)


def test_serve_starts_on_the_tiny_deepseek_v3_checkpoint_and_loads_exports_of_it_from_disk(example, tmp_path):
    """`serve` on the example's own checkpoint (its MTP layer aboard; before: ValueError at start, so a job with CPU
    engines could not start), generating; then disk updates from another checkpoint with the MTP layer and from
    one without it (num_nextn_predict_layers 0: the engine serves the main model either way), and a tensor update
    holding the MTP layer."""
    from megatron_pdm.rollout.sglang import weight_transfer as wt
    from megatron_pdm.rollout.sglang.pool import post

    cfg = example.tiny_deepseek_v3_config()
    first = example.write_checkpoint(tmp_path / "a", seed=0)
    second = example.write_checkpoint(tmp_path / "b", seed=1)
    main, _ = load_hf_checkpoint(second)
    plain = tmp_path / "c"
    save_hf_checkpoint(plain, {k: main[k] for k in main if not k.startswith("model.layers.3.")},
                       replace(cfg, mtp_num_layers=0), fp8_blocks=True)
    server, url, stop = _in_process_server(tmp_path, cfg, path=str(first))
    try:
        out = post(url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}, 30)
        assert len(out["output_ids"]) == 2
        for version, path in ((2, second), (3, plain)):
            assert post(url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version)},
                        30)["success"]
            assert server.engine.weight_version == version
            assert torch.equal(server.engine.model.state_dict()["model.embed_tokens.weight"],
                               main["model.embed_tokens.weight"])
        # a tensor update carrying the MTP layer in bf16 (this engine is FP8): skipped, not refused as plain weights
        mtp = [(k, main[k].to(torch.bfloat16)) for k in main if k.startswith("model.layers.3.")]
        post(url, "/begin_weight_update", {}, 30)
        body = {"serialized_named_tensors": [wt.serialize_named_tensors(wt.shared(mtp))], "weight_version": "4"}
        assert post(url, "/update_weights_from_tensor", body, 30)["success"]
        assert post(url, "/end_weight_update", {}, 30)["success"] and server.engine.weight_version == 4
    finally:
        stop()
