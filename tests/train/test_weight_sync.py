"""Bounded-memory weight sync (train/weight_sync.py, models/hf/export.py `hf_buckets_from_model`): the weights an engine
receives equal the full HF state bit for bit under TP, EP and uneven PP, each stage sends only its own layers,
buckets respect their size, the peak memory of a sync stays under `weight_sync_peak_bytes`, and uneven pipeline
stages import and export HF checkpoints."""

import os
import re
from pathlib import Path

import pytest
import torch

from megatron_pdm.models import (
    ModelConfig,
    ParallelConfig,
    canonical_hf_state,
    hf_state_from_model,
)
from tests.helpers import DENSE, MOE, _setup, hf_model, rank_buckets_and_sync

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DENSE5 = ModelConfig(**{**DENSE.__dict__, "num_layers": 5})  # 3 + 2 layers over two pipeline stages
UNEVEN = dict(pipeline=2, first_stage_layers=3)


@pytest.mark.parametrize("cfg,parallel", [(DENSE, dict(tensor=2)), (DENSE5, UNEVEN), (MOE, dict(expert=2)),
                                          (MOE, dict(tensor=2))], ids=["dense-tp2", "dense-pp2-3+2", "moe-ep2",
                                                                       "moe-tp2"])
def test_synced_weights_equal_the_full_hf_state(dist_pools, cfg, parallel):
    state = canonical_hf_state(hf_model(cfg, seed=7).state_dict())
    bucket_bytes = 8192  # small enough that every stage sends several buckets
    results = dist_pools(2).run(rank_buckets_and_sync, shared=(cfg, ParallelConfig(**parallel), state,
                                                               bucket_bytes))
    synced = results[0][1]
    assert synced.keys() == state.keys()
    for k in state:  # bit-exact: gathers and the layout conversion only move bytes
        assert torch.equal(synced[k], state[k]), k
    seen = {}
    for rank, (buckets, _, stage, sender) in enumerate(results):
        assert bool(buckets) == sender, f"rank {rank}: only the stage's sender yields buckets"
        for b in buckets:
            nbytes = sum(t.numel() * t.element_size() for t in b.values())
            # at most bucket_bytes, unless one gathered item (a weight, or an expert slot's EP experts) exceeds it:
            # then that item is a bucket alone
            assert nbytes <= bucket_bytes or len({_item(k) for k in b}) == 1, (rank, nbytes, list(b))
            for k, t in b.items():
                assert k not in seen, f"{k} sent twice"
                seen[k] = (stage, t)
    assert seen.keys() == state.keys()
    assert all(torch.equal(t, state[k]) for k, (_, t) in seen.items())
    if parallel.get("pipeline") == 2:  # each stage sends its own layers: 0-2 and the embedding, 3-4 and the head
        layer_of = {k: int(k.split(".")[2]) for k in seen if k.startswith("model.layers.")}
        assert {i for k, i in layer_of.items() if seen[k][0] == 0} == {0, 1, 2}
        assert {i for k, i in layer_of.items() if seen[k][0] == 1} == {3, 4}
        assert seen["model.embed_tokens.weight"][0] == 0 and seen["lm_head.weight"][0] == 1


def _item(key: str) -> str:
    """The gathered item an HF key comes from: q / k / v of one layer together, gate / up together, an expert
    layer's experts together."""
    key = re.sub(r"experts\.\d+\.", "experts.*.", key)
    return re.sub(r"(q|k|v)_proj", "qkv", re.sub(r"(gate|up)_proj", "fc1", key))


def rank_roundtrip(group, cfg, parallel, state):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    model, ctx = _setup(cfg, parallel, state)
    (layers,) = ctx.chunk_layers(cfg.num_layers)
    # what megatron built agrees with the context's layers
    start = get_transformer_layer_offset(model.config, pp_rank=ctx.pp_rank)
    assert range(start, start + get_num_layers_to_build(model.config, pp_rank=ctx.pp_rank)) == layers
    exported = hf_state_from_model(model, cfg, ctx)
    ctx.close()
    return (layers.start, layers.stop), exported


def test_uneven_pipeline_stages_import_and_export(dist_pools):
    """5 layers over PP = 2 as 3 + 2 (parallel.first_stage_layers): each stage imports its own global layers from
    the HF checkpoint, and the export (every stage's part) is the checkpoint again."""
    state = canonical_hf_state(hf_model(DENSE5, seed=9).state_dict())
    results = dist_pools(2).run(rank_roundtrip, shared=(DENSE5, ParallelConfig(**UNEVEN), state))
    assert [r[0] for r in results] == [(0, 3), (3, 5)]
    for _, exported in results:
        assert exported.keys() == state.keys()
        assert all(torch.equal(exported[k], state[k]) for k in state)


# ---------------------------------------------------------------------------------------------- memory

BIG = ModelConfig(vocab_size=8192, hidden_size=256, num_layers=8, num_attention_heads=4, num_query_groups=2,
                  head_dim=64, ffn_hidden_size=1024, max_position_embeddings=64)  # 12 M parameters, 46 MiB fp32


def rank_peak_memory(group, cfg, parallel, state, bucket_bytes):
    """Peak resident memory added by the all-gather export and by a bucketed export (consumed and dropped bucket by
    bucket, as an engine does), on this rank (bytes)."""
    from megatron_pdm.models.hf import hf_buckets_from_model
    from tests.memory import peak_extra_bytes

    model, ctx = _setup(cfg, parallel, state)
    del state

    def old():
        hf_state_from_model(model, cfg, ctx)

    def new(**fmt):
        for bucket in hf_buckets_from_model(model, cfg, ctx, bucket_bytes=bucket_bytes, **fmt):
            del bucket

    result = (peak_extra_bytes(old), peak_extra_bytes(new),
              peak_extra_bytes(lambda: new(dtype=torch.bfloat16, fp8=True)))  # an FP8 engine's export
    ctx.close()
    return result


@pytest.mark.parametrize("parallel", [dict(tensor=2), dict(pipeline=2)], ids=["tp2", "pp2"])
def test_sync_peak_memory_is_bounded(dist_pools, parallel):
    """Measured peak RSS (VmHWM, with glibc returning every block >= 64 KiB to the OS at free, so that RSS follows
    the live tensors): the bucketed export stays under weight_sync_peak_bytes plus 4 MiB for the interpreter and
    gloo's own buffers (allocator noise measured at under 1 MiB here), where the all-gather held the whole model."""
    from megatron_pdm.train.weight_sync import weight_sync_peak_bytes

    state = canonical_hf_state(hf_model(BIG, seed=1).state_dict())
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    bucket_bytes = 4 << 20
    par = ParallelConfig(**parallel)
    bound = weight_sync_peak_bytes(BIG, par, bucket_bytes=bucket_bytes)
    fp8_bound = weight_sync_peak_bytes(BIG, par, bucket_bytes=bucket_bytes, rollout="fp8")
    results = dist_pools(2).run(rank_peak_memory, shared=(BIG, par, state, bucket_bytes))
    for rank, (old, new, fp8) in enumerate(results):
        assert old >= 0.95 * model_bytes, (rank, old, model_bytes)
        assert new <= bound + (4 << 20), (rank, new, bound)
        assert fp8 <= fp8_bound + (4 << 20), (rank, fp8, fp8_bound)
    assert bound < model_bytes / 2


def rank_engine_format(group, cfg, parallel, state, rollout):
    """One sync into a real embedded engine of the `rollout` format on rank 0, recording what reaches it (name ->
    dtype) and the weights it then holds; per rank the bytes it gathered in and sent to rank 0."""
    import torch.distributed as dist

    from megatron_pdm.precision import rollout_engine_dtype
    from megatron_pdm.rollout import EmbeddedEngine
    from megatron_pdm.train.weight_sync import sync_weights
    from tests.memory import moved_bytes

    model, ctx = _setup(cfg, parallel, state)
    arrived, engine = {}, None
    if dist.get_rank() == 0:
        dtype, quantization = rollout_engine_dtype(rollout)
        engine = EmbeddedEngine(cfg, dtype=dtype, quantization=quantization)
        real_update = engine.update_weights

        def update_weights(weights, version):  # what arrives, then the engine's own update
            def seen(stream):
                for bucket in stream:
                    arrived.update({k: t.dtype for k, t in bucket.items()})
                    yield bucket
            real_update(seen(weights), version)

        engine.update_weights = update_weights
    with moved_bytes() as moved:
        sync_weights(model, cfg, engine, 1, ctx, bucket_bytes=4096, rollout=rollout)
    held = None if engine is None else {k: v.clone() for k, v in canonical_hf_state(engine.model.state_dict()).items()}
    ctx.close()
    return arrived, held, moved


@pytest.mark.parametrize("parallel", [dict(tensor=2), UNEVEN], ids=["tp2", "pp2-3+2"])
def test_weights_travel_in_the_engines_format_from_the_senders(dist_pools, parallel):
    """The sync converts on each stage's sender: a bf16 engine's weights are gathered and relayed as bf16 (half the
    bytes of the fp32 parameters), an FP8 engine's linear weights arrive as block-FP8 pairs quantized from the fp32
    values (a quarter of the bytes from a later stage); the engine ends up holding exactly what converting at rank 0
    gave (bf16 rounding; quantize-dequantize of the fp32 weights)."""
    from megatron_pdm.precision import FP8_SCALE_SUFFIX, fp8_block_dequantize, fp8_block_quantize, fp8_quantizable

    cfg = DENSE5 if parallel.get("pipeline") else DENSE
    state = canonical_hf_state(hf_model(cfg, seed=9).state_dict())
    runs = {r: dist_pools(2).run(rank_engine_format, shared=(cfg, ParallelConfig(**parallel), state, r))
            for r in ("fp32", "bf16", "fp8")}
    (arrived32, held32, moved32), (_, _, moved32_1) = runs["fp32"]
    (arrived16, held16, moved16), (_, _, moved16_1) = runs["bf16"]
    (arrived8, held8, moved8), (_, _, moved8_1) = runs["fp8"]
    assert set(arrived32.values()) == {torch.float32} and set(arrived16.values()) == {torch.bfloat16}
    if parallel.get("tensor"):  # rank 0 gathers rank 1's shards: half the bytes in bf16
        assert moved16["gathered"] * 2 == moved32["gathered"] > 0
    else:  # stage 1's sender relays its layers to rank 0: 4 bytes an element in fp32, 2 in bf16, 1 in FP8 (+ scales)
        stage1 = {k: w for k, w in state.items() if k in ("model.norm.weight", "lm_head.weight")
                  or k.startswith("model.layers.") and int(k.split(".")[2]) >= 3}
        assert moved32_1["sent"] == 4 * sum(w.numel() for w in stage1.values())
        assert moved16_1["sent"] * 2 == moved32_1["sent"]
        assert moved8_1["sent"] == sum(w.numel() + 4 * fp8_block_quantize(w)[1].numel() if fp8_quantizable(k, w)
                                       else 2 * w.numel() for k, w in stage1.items())
    for k, w in state.items():
        torch.testing.assert_close(held32[k], w, atol=0, rtol=0)
        torch.testing.assert_close(held16[k], w.to(torch.bfloat16), atol=0, rtol=0)
        if fp8_quantizable(k, w):
            assert arrived8[k] == torch.float8_e4m3fn and arrived8[k + FP8_SCALE_SUFFIX] == torch.float32
            expected = fp8_block_dequantize(*fp8_block_quantize(w), torch.bfloat16)
        else:
            assert arrived8[k] == torch.bfloat16
            expected = w.to(torch.bfloat16)
        torch.testing.assert_close(held8[k], expected, atol=0, rtol=0)


def rank_tensor_mail(group, tensors, extra):
    """Rank 0 mails `tensors` and `extra` to rank 1, then the end marker; rank 1 broadcasts what it got back to the
    group (the two patterns of megatron_pdm._bytes)."""
    import torch.distributed as dist

    from megatron_pdm._bytes import broadcast_tensors, recv_tensors, send_tensors

    cpu = torch.device("cpu")
    got = None
    if dist.get_rank() == 0:
        assert send_tensors(tensors, 1, staging=cpu, extra=extra) == sum(t.numel() * t.element_size()
                                                                         for t in tensors.values())
        send_tensors(None, 1, staging=cpu)
    else:
        got = recv_tensors(0, device=cpu)
        assert recv_tensors(0, device=cpu) is None  # the end marker
    back, back_extra = broadcast_tensors(None if got is None else got[0], 1, group, device=cpu,
                                         extra=None if got is None else got[1])
    return back, back_extra


def test_tensor_mail_point_to_point_and_broadcast(dist_pools):
    """Names, dtypes (float8 and int16 travel as bytes over gloo), shapes, values and the extra arrive whole."""
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 5, generator=g), "fp8": torch.randn(4, 2, generator=g).to(torch.float8_e4m3fn),
               "ids": torch.arange(7, dtype=torch.int16), "empty": torch.zeros(0, 3)}
    for back, extra in dist_pools(2).run(rank_tensor_mail, shared=(tensors, {"offsets": (0, 3)})):
        assert extra == {"offsets": (0, 3)} and list(back) == list(tensors)
        for k, t in tensors.items():
            assert back[k].dtype == t.dtype and torch.equal(back[k].view(torch.uint8), t.view(torch.uint8)), k


def rank_stage_export(group, cfg, parallel, state, rollout, urls, weight_dir):
    """Each stage writes its own shards of one export for an SGLang engine (a `serve` worker) under disk sync; per
    rank: (bytes sent point to point, the export's files, what the engine answers after the update)."""
    import torch.distributed as dist

    from megatron_pdm.precision import rollout_engine_dtype
    from megatron_pdm.rollout import SamplingParams
    from megatron_pdm.rollout.sglang.client import SGLangEngine
    from megatron_pdm.train.weight_sync import sync_weights
    from tests.helpers import sglang_section
    from tests.memory import moved_bytes

    model, ctx = _setup(cfg, parallel, state)
    engine = None
    if dist.get_rank() == 0:
        dtype, quantization = rollout_engine_dtype(rollout)
        engine = SGLangEngine(sglang_section(urls=urls, timeout_s=60, retries=0), cfg, weight_dir=weight_dir,
                              dtype=dtype, quantization=quantization)
        engine.wait_ready(60)
    with moved_bytes() as moved:
        sync_weights(model, cfg, engine, 3, ctx, bucket_bytes=8192, rollout=rollout)
    answered = None
    if engine is not None:
        out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, n=1, top_k_logprobs=2, seed=1))
        answered = (engine.weight_version, [s.weight_version for s in out], str(engine.pool.export[0]))
        sync_weights(model, cfg, engine, 4, ctx, bucket_bytes=8192, rollout=rollout)  # replaces v3 (restarts: v4)
        answered += (str(engine.pool.export[0]),)
    else:
        sync_weights(model, cfg, engine, 4, ctx, bucket_bytes=8192, rollout=rollout)
    ctx.close()
    return moved["sent"], answered


@pytest.mark.e2e
@pytest.mark.parametrize("parallel,rollout", [(dict(pipeline=2), "bf16"), (dict(tensor=2), "fp32")],
                         ids=["pp2-bf16", "tp2-fp32"])
def test_disk_sync_each_stage_writes_its_own_shards(dist_pools, tmp_path, parallel, rollout):
    """Under `weight_sync: disk` no weight crosses between stages: each stage's sender writes its own layers as
    shards of one export (model-pp<stage>-*), rank 0 completes it (index, config.json) and the engine loads it;
    the export is exactly the HF state in the engine's dtype, and the next one replaces it."""
    import json

    from megatron_pdm.models import load_hf_checkpoint
    from megatron_pdm.models.hf import HF_INDEX
    from tests.helpers import _serve_processes, _stop

    cfg = DENSE  # the model the serve worker holds
    state = canonical_hf_state(hf_model(cfg, seed=11).state_dict())
    procs, urls, _ = _serve_processes(tmp_path, 1)
    try:
        (sent0, answered), (sent1, _) = dist_pools(2).run(
            rank_stage_export, shared=(cfg, ParallelConfig(**parallel), state, rollout, urls, tmp_path / "weights"))
    finally:
        _stop(procs)
    version, sample_versions, first_export, last_export = answered
    assert version == 3 and sample_versions == [3]  # the engine loaded the export the stages wrote
    assert sent0 == sent1 == 0  # nothing relayed through rank 0
    assert first_export.endswith("v000003") and last_export.endswith("v000004")
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000004"]
    export = tmp_path / "weights" / "v000004"
    weight_map = json.loads((export / HF_INDEX).read_text())["weight_map"]
    by_stage = {}
    for key, file in weight_map.items():
        by_stage.setdefault(file.split("-")[1], set()).add(key)
    if parallel.get("pipeline"):  # stage 1 (layer 1, norm, head) wrote its own files
        assert sorted(by_stage) == ["pp000", "pp001"]
        assert "lm_head.weight" in by_stage["pp001"] and "model.embed_tokens.weight" in by_stage["pp000"]
        assert {int(k.split(".")[2]) for k in by_stage["pp001"] if k.startswith("model.layers.")} == {1}
    else:
        assert sorted(by_stage) == ["pp000"]
    held, _ = load_hf_checkpoint(export)
    dtype = torch.bfloat16 if rollout == "bf16" else torch.float32
    assert set(held) == set(state)
    for k, w in state.items():
        assert torch.equal(held[k], w.to(dtype)), k
    config = json.loads((export / "config.json").read_text())
    assert config.get("torch_dtype") == ("bfloat16" if rollout == "bf16" else "float32")


def test_the_fp8_bound_counts_weights_quantized_before_the_gather():
    """`weight_sync_peak_bytes` for an FP8 engine: where every TP shard holds whole 128 x 128 blocks the quantized
    weights are gathered as 1 byte + scales (counted as bf16's 2), else as the fp32 parameters; the quantization's
    float32 temporaries (row chunks) come on top, on every rank."""
    from megatron_pdm.precision import FP8_QUANTIZE_CHUNK_BYTES
    from megatron_pdm.train.weight_sync import weight_sync_peak_bytes

    aligned = ModelConfig(vocab_size=4096, hidden_size=1024, num_layers=2, num_attention_heads=16,
                          num_query_groups=8, head_dim=64, ffn_hidden_size=3072, max_position_embeddings=64)
    tp2 = ParallelConfig(tensor=2)

    def bound(cfg, rollout):
        return weight_sync_peak_bytes(cfg, tp2, bucket_bytes=1 << 20, rollout=rollout)

    quantizing = 3 * FP8_QUANTIZE_CHUNK_BYTES  # the quantization's float32 temporaries, on every rank
    assert bound(aligned, "fp8") - quantizing == bound(aligned, "bf16") < bound(aligned, "fp32")
    assert bound(BIG, "bf16") < bound(BIG, "fp8") - quantizing  # BIG's k / v shards are 64 rows: gathered in fp32


def rank_stage_export_failure(group, urls, weight_dir, fault):
    """PP = 2 disk sync into a `serve` worker where stage 1's sender cannot write (fault "full": its disk fills
    after one shard) or writes where rank 0 cannot see (fault "local": a node-local weight_dir); then a sync without
    the fault. Per rank: (the error of the first sync, the engine's version after the second: rank 0 only)."""
    import torch.distributed as dist

    from megatron_pdm.models.hf import save_hf_shards
    from megatron_pdm.rollout.sglang.client import SGLangEngine
    from megatron_pdm.train import weight_sync
    from tests.helpers import sglang_section

    state = canonical_hf_state(hf_model(DENSE, seed=11).state_dict())
    model, ctx = _setup(DENSE, ParallelConfig(pipeline=2), state)
    engine = None
    if dist.get_rank() == 0:
        engine = SGLangEngine(sglang_section(urls=urls, timeout_s=60, retries=0), DENSE, weight_dir=weight_dir,
                              dtype="float32")
        engine.wait_ready(60)

    def faulty(directory, buckets, prefix):
        if fault == "local":
            return save_hf_shards(Path(str(directory) + "-node-local"), buckets, prefix=prefix)
        for bucket in buckets:
            save_hf_shards(directory, [bucket], prefix=prefix)
            raise OSError(28, "No space left on device")

    error = None
    if dist.get_rank() == 1:
        weight_sync.save_hf_shards = faulty
    try:
        weight_sync.sync_weights(model, DENSE, engine, 1, ctx, bucket_bytes=4096)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    weight_sync.save_hf_shards = save_hf_shards
    weight_sync.sync_weights(model, DENSE, engine, 2, ctx, bucket_bytes=4096)  # the collectives still line up
    ctx.close()
    return error, None if engine is None else engine.weight_version


@pytest.mark.e2e
@pytest.mark.parametrize("fault", ["full", "local"])
def test_a_stage_that_cannot_write_its_shards_fails_every_rank_naming_it(dist_pools, tmp_path, fault):
    """A stage's failed write (a full disk) or shards rank 0 cannot see (a weight_dir that is not shared between
    the trainer's nodes) fail the sync on every rank at once with a message naming the stage, before any engine
    loads a partial export; nothing hangs, and the next sync goes through."""
    from tests.helpers import _serve_processes, _stop

    procs, urls, _ = _serve_processes(tmp_path, 1)
    try:
        (error0, version), (error1, _) = dist_pools(2).run(
            rank_stage_export_failure, shared=(urls, tmp_path / "weights", fault))
    finally:
        _stop(procs)
    assert error0 == error1, (error0, error1)
    if fault == "full":
        assert "stage 1's sender could not write its shards" in error0 and "No space left on device" in error0
    else:
        assert "stage 1's sender wrote" in error0 and "does not see" in error0 and "rollout.sglang.weight_dir" in error0
    assert version == 2


def _pp2_distributed(urls, state, weight_dir, *, timeout_s: float):
    """This rank's PP = 2 model of DENSE, its context, the SGLang engine over `urls` under distributed sync (rank 0;
    None elsewhere, requests and updates timing out after timeout_s) and a `WeightSync`."""
    import torch.distributed as dist

    from megatron_pdm.rollout.sglang.client import SGLangEngine
    from megatron_pdm.train.weight_sync import WeightSync
    from tests.helpers import sglang_section

    model, ctx = _setup(DENSE, ParallelConfig(pipeline=2), state)
    engine = None
    if dist.get_rank() == 0:
        engine = SGLangEngine(sglang_section(urls=urls, timeout_s=timeout_s, retries=0, weight_sync="distributed",
                                             sync_bucket_bytes=4096), DENSE, weight_dir=weight_dir, dtype="float32")
        engine.wait_ready(60)
    return model, ctx, engine, WeightSync()


def rank_stage_broadcasts(group, urls, state, weight_dir, failing_stage):
    """PP = 2 distributed sync into two `serve` workers, each stage's sender over its own weights group: v1; v2 with
    worker 1 failing the load of the first bucket it takes from stage `failing_stage`; v3 on the survivor, over
    groups made anew. Per rank: (bytes sent point to point, rank 0: (samples at v1, samples at v3, workers alive,
    worker 0's request counts since v1))."""
    import torch.distributed as dist

    from megatron_pdm.rollout import SamplingParams
    from megatron_pdm.rollout.sglang.pool import post, request
    from tests.memory import moved_bytes

    model, ctx, engine, sync = _pp2_distributed(urls, state, weight_dir, timeout_s=60)
    out = None
    params = SamplingParams(max_new_tokens=4, n=2, temperature=0.8, top_k_logprobs=3, seed=3)
    with moved_bytes() as moved:
        sync(model, DENSE, engine, 1, ctx, bucket_bytes=4096)
    if engine is not None:
        out = [engine.generate([[5, 6, 7], [8, 9]], params)]
        post(urls[0], "/megatron_pdm/faults", {}, 10)  # counts requests from here on
        post(urls[1], "/megatron_pdm/faults", {"fail_updates": 1, "fail_group": f"-pp{failing_stage}-"}, 10)
    dist.barrier()
    sync(model, DENSE, engine, 2, ctx, bucket_bytes=4096)
    sync(model, DENSE, engine, 3, ctx, bucket_bytes=4096)
    if engine is not None:
        out += [engine.generate([[5, 6, 7], [8, 9]], params), list(engine.pool.alive),
                [request(u, "/megatron_pdm/faults", None, 10) for u in urls]]
    sync.close()
    if engine is not None:
        engine.close()
    ctx.close()
    return moved["sent"], out


@pytest.mark.e2e
@pytest.mark.parametrize("failing_stage", [0, 1])
def test_distributed_sync_each_stage_broadcasts_over_its_own_group(dist_pools, tmp_path, failing_stage):
    """Under `weight_sync: distributed` with PP = 2 each stage's sender joins the engines in a weights group of its
    own and broadcasts its own layers, in turn (nothing relayed through rank 0); the engines hold exactly the model
    (their log-probs are the trainer's); a worker that fails a load under stage 0's broadcast (rank 0's pool sees
    it) or stage 1's (its sender reports it) is dropped and the update completes on the other; the next update
    makes the groups that held it anew."""
    from tests.helpers import _serve_processes, _stop, rank_engine_check

    state = canonical_hf_state(hf_model(DENSE, seed=13).state_dict())
    procs, urls, _ = _serve_processes(tmp_path, 2, MEGATRON_PDM_SERVE_TEST_HOOKS="1")
    try:
        (sent0, out), (sent1, _) = dist_pools(2).run(rank_stage_broadcasts,
                                                      shared=(urls, state, tmp_path / "weights", failing_stage))
    finally:
        _stop(procs)
    v1, v3, alive, faults = out
    assert sent0 == sent1 == 0  # no weight relayed through rank 0
    assert alive == [urls[0]]  # worker 1 failed a load at v2: dropped, the update went on
    assert all(s.weight_version == 1 for s in v1) and all(s.weight_version == 3 for s in v3)
    received = faults[0]["received"]  # since v1: v2 and v3 on the survivor
    # two groups made anew without worker 1: the failing stage's at v2 (to send the bucket again), the other's at v3
    assert received["/init_weights_update_group"] == 2 and received["/update_weights_from_distributed"] >= 4
    for samples in (v1, v3):  # the engine's log-probs are the trainer model's: every weight arrived, in place
        recomputed = dist_pools(1).run(rank_engine_check, shared=(DENSE, 1, state, 0.8, samples))[0]
        for s, (lp, top) in zip(samples, recomputed, strict=True):
            torch.testing.assert_close(s.token_logprobs, lp, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(s.topk_logprobs, top, atol=1e-4, rtol=1e-4)


def rank_stage_refusal(group, urls, state, weight_dir):
    """PP = 2 distributed sync: v1; then v2 with worker 1 refusing the first announcement it gets (whichever
    stage's) before it takes part. Per rank: (the error rank 0's update raised and its seconds, None elsewhere)."""
    import time

    import torch.distributed as dist

    from megatron_pdm.rollout.sglang.pool import post

    model, ctx, engine, sync = _pp2_distributed(urls, state, weight_dir, timeout_s=8)
    out = None
    sync(model, DENSE, engine, 1, ctx, bucket_bytes=4096)
    if engine is not None:
        post(urls[1], "/megatron_pdm/faults", {"refuse_updates": 1}, 10)
    dist.barrier()
    start = time.monotonic()
    try:
        sync(model, DENSE, engine, 2, ctx, bucket_bytes=4096)
    except Exception as e:
        out = (type(e).__name__, str(e), time.monotonic() - start, list(engine.pool.alive))
    sync.close()
    ctx.close()
    return out


@pytest.mark.e2e
def test_a_refused_stage_broadcast_fails_the_update_within_the_timeout(dist_pools, tmp_path):
    """A worker refusing a stage's announcement before it takes part aborts that stage's group after the refusal's
    grace and the later stage's turn is skipped: the update fails on rank 0 with UpdateAborted naming the refusing
    worker, within the update timeout, never hangs, and takes both workers out of service (the other one is left
    waiting in the aborted broadcast)."""
    from tests.helpers import _serve_processes, _stop

    state = canonical_hf_state(hf_model(DENSE, seed=13).state_dict())
    procs, urls, _ = _serve_processes(tmp_path, 2, MEGATRON_PDM_SERVE_TEST_HOOKS="1")
    try:
        (error, _) = dist_pools(2).run(rank_stage_refusal, shared=(urls, state, tmp_path / "weights"))
    finally:
        _stop(procs)
    name, message, seconds, alive = error
    assert name == "UpdateAborted" and f"refused by {urls[1]}" in message, message
    assert seconds < 8 + 5 + 5, seconds  # the update timeout, the refusal's grace, start-up: not a hang
    assert alive == []
