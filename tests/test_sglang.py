"""The SGLangEngine client against real `megatron-pdm serve` workers on loopback (SGLang's API, CPU engine)."""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_pdm.models import canonical_hf_state, save_hf_checkpoint
from megatron_pdm.rollout import SamplingParams
from megatron_pdm.rollout.sglang import SGLangEngine, parse_generate_output
from tests.test_models import DENSE, hf_model, rank_engine_check

ROOT = Path(__file__).resolve().parents[1]


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def workers(tmp_path):
    """Two serve processes on free loopback ports, stopped (only those) at the end."""
    state = canonical_hf_state(hf_model(DENSE, seed=21).state_dict())
    save_hf_checkpoint(tmp_path / "init", state, DENSE)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs, urls = [], []
    for _ in range(2):
        port = _port()
        procs.append(subprocess.Popen([sys.executable, "-m", "megatron_pdm.cli", "serve", "--model-path",
                                       str(tmp_path / "init"), "--port", str(port)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    engine = SGLangEngine(urls, DENSE, weight_dir=tmp_path / "weights", timeout=30, retries=1, backoff=0.1)
    engine.wait_ready(120)
    yield engine, procs, state
    for p in procs:
        p.kill()
        p.wait()


def test_logprobs_weight_updates_and_a_dead_worker(dist_pools, workers):
    engine, procs, state = workers
    engine.update_weights(state, version=1)
    params = SamplingParams(max_new_tokens=5, n=3, temperature=0.7, top_k_logprobs=4, stop_token_ids=(3,), seed=5)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    samples = engine.generate(prompts, params)
    assert [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(s.weight_version == 1 for s in samples)
    # log mu = log_softmax(logits / T): the trainer's recomputation with the same T agrees
    recomputed = dist_pools(1).run(rank_engine_check, shared=(DENSE, 1, state, 0.7, samples))[0]
    for s, (lp, top) in zip(samples, recomputed, strict=True):
        torch.testing.assert_close(s.token_logprobs, lp, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s.topk_logprobs, top, atol=1e-4, rtol=1e-4)

    # colocated engines free their memory while the trainer trains: no generation until memory and weights are back
    engine.release_memory()
    assert engine.health() and len(engine.alive) == 2
    with pytest.raises(ValueError, match="HTTP 400.*memory released"):
        engine.generate(prompts, params)
    new_state = canonical_hf_state(hf_model(DENSE, seed=22).state_dict())
    engine.update_weights(new_state, version=2)  # resumes the memory first
    assert not engine.released
    samples = engine.generate(prompts, params)
    assert all(s.weight_version == 2 for s in samples)
    recomputed = dist_pools(1).run(rank_engine_check, shared=(DENSE, 1, new_state, 0.7, samples))[0]
    for s, (lp, _) in zip(samples, recomputed, strict=True):
        torch.testing.assert_close(s.token_logprobs, lp, atol=1e-4, rtol=1e-4)

    # kill one worker mid-rollout: every prompt is answered exactly once, by the survivor
    many = [[5 + i % 20, 6] for i in range(40)]
    killer = threading.Thread(target=lambda: (time.sleep(0.3), procs[1].kill()))
    killer.start()
    out = engine.generate(many, SamplingParams(max_new_tokens=8, n=2, top_k_logprobs=3, seed=1))
    killer.join()
    assert [s.prompt_index for s in out] == [i for i in range(40) for _ in range(2)]
    assert len(engine.alive) == 1
    with pytest.raises(ValueError, match="HTTP 400.*input_ids"):
        from megatron_pdm.rollout.sglang import _post

        _post(engine.alive[0], "/generate", {"input_ids": [], "sampling_params": {}}, 10)


def test_malformed_outputs_name_the_field():
    good = {"meta_info": {"output_token_logprobs": [[-0.5, 3, None]], "output_top_logprobs": [[[-0.5, 3, None],
                                                                                               [-1.0, 4, None]]],
                          "weight_version": "2", "finish_reason": {"type": "stop"}}}
    kw = dict(prompt_index=0, prompt_ids=[1], k=2, vocab_size=10, weight_version=2)
    s = parse_generate_output(good, **kw)
    assert s.response_ids.tolist() == [3] and s.finish_reason == "stop"
    cases = [
        ({"meta_info": {}}, "output_token_logprobs: missing"),
        ({"meta_info": {"output_token_logprobs": [[-0.5, 3, None]], "output_top_logprobs": [[[-0.5, 3, None]]]}},
         r"output_top_logprobs\[0\]: expected 2 entries, got 1"),
        ({"meta_info": {"output_token_logprobs": [[-0.5, 30, None]],
                        "output_top_logprobs": [[[-0.5, 3, None], [-1, 4, None]]]}}, "token id 30 outside"),
        ({"meta_info": {"output_token_logprobs": [[float("nan"), 3, None]],
                        "output_top_logprobs": [[[-0.5, 3, None], [-1, 4, None]]]}}, "is not finite"),
        ({"meta_info": {**good["meta_info"], "weight_version": "1"}}, "weight_version: 1, but the trainer pushed 2"),
        ({"text": ""}, "meta_info: missing"),
    ]
    for out, msg in cases:
        with pytest.raises(ValueError, match=msg):
            parse_generate_output(out, **kw)
    # routed experts: base64 int32 [prompt + completion - 1, layers, top_k]
    import base64

    routed = kw | {"prompt_ids": [1, 2], "routed_experts": (3, 2, 4)}  # 2 + 1 - 1 = 2 positions, 3 layers, top 2
    enc = lambda t: base64.b64encode(torch.tensor(t, dtype=torch.int32).numpy().tobytes()).decode()  # noqa: E731
    ok = [[[0, 1], [2, 3], [1, 0]]] * 2
    s = parse_generate_output({"meta_info": {**good["meta_info"], "routed_experts": enc(ok)}}, **routed)
    assert s.routed_experts.tolist() == ok
    for value, msg in ((None, "missing"), ("!!", "not base64"), (enc(ok[:1]), "expected int32 "
                       r"\[2, 3, 2\]"), (enc([[[0, 4], [2, 3], [1, 0]]] * 2), r"outside \[0, 4\)")):
        with pytest.raises(ValueError, match=f"meta_info.routed_experts: .*{msg}"):
            parse_generate_output({"meta_info": {**good["meta_info"], "routed_experts": value}}, **routed)


def rank_train(group, cfg, run_dir):
    from megatron_pdm.models import destroy_parallel
    from megatron_pdm.train.trainer import Trainer

    rows = Trainer(cfg, Path(run_dir)).run()
    destroy_parallel()
    return rows


def test_trainer_rolls_out_through_sglang_workers(dist_pools, workers, tmp_path):
    from tests.test_train import _cfg

    engine, _, _ = workers
    cfg = _cfg(DENSE.__dict__, {}, tmp_path / "init", steps=2, warm_start_steps=5)
    d = cfg.to_dict()
    d["rollout"].update(engine="sglang", urls=list(engine.urls))
    from megatron_pdm.train.config import config_from_dict

    rows = dist_pools(1).run(rank_train, shared=(config_from_dict(d), str(tmp_path / "run")))[0]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "run" / "weights").iterdir()) == ["v000000", "v000001", "v000002"]


def _recompute_check(dist_pools, state, samples, temperature):
    recomputed = dist_pools(1).run(rank_engine_check, shared=(DENSE, 1, state, temperature, samples))[0]
    for s, (lp, top) in zip(samples, recomputed, strict=True):
        torch.testing.assert_close(s.token_logprobs, lp, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s.topk_logprobs, top, atol=1e-4, rtol=1e-4)


def _launched(tmp_path, num_engines, **kw):
    from megatron_pdm.rollout.launcher import LaunchSpec

    spec = LaunchSpec(server="megatron-pdm", num_engines=num_engines, dtype="float32", log_dir=tmp_path / "logs",
                      startup_timeout_s=120)
    return SGLangEngine((), DENSE, weight_dir=tmp_path / "weights", launch=spec, timeout=30, retries=1,
                        backoff=0.1, **kw)


def test_launched_engines_distributed_sync_and_restart(dist_pools, tmp_path, caplog):
    """Engines we launch: weights by broadcast over a gloo group of the trainer and both engines; a killed
    engine is restarted from the last disk export while its prompts go to the other, and rejoins the group at
    the next update."""
    engine = _launched(tmp_path, 2, weight_sync="distributed", bucket_bytes=4096)
    try:
        state0 = canonical_hf_state(hf_model(DENSE, seed=31).state_dict())
        engine.update_weights(state0, version=0)  # starts both from the export v000000
        assert len(engine.alive) == 2 and engine.export[1] == 0
        state1 = canonical_hf_state(hf_model(DENSE, seed=32).state_dict())
        engine.update_weights(state1, version=1)  # broadcast, in buckets of <= 4 KiB
        assert engine._group is not None and len(weight_transfer_buckets(state1, 4096)) > 3
        params = SamplingParams(max_new_tokens=4, n=2, temperature=0.8, top_k_logprobs=3, seed=3)
        samples = engine.generate([[5, 6, 7], [8, 9]], params)
        assert all(s.weight_version == 1 for s in samples)
        _recompute_check(dist_pools, state1, samples, 0.8)

        victim = engine.alive[1]
        many = [[5 + i % 20, 6] for i in range(40)]
        killer = threading.Thread(target=lambda: (time.sleep(0.3), engine.procs[victim].proc.kill()))
        killer.start()
        with caplog.at_level("WARNING"):
            out = engine.generate(many, SamplingParams(max_new_tokens=8, n=2, top_k_logprobs=3, seed=1))
        killer.join()
        assert [s.prompt_index for s in out] == [i for i in range(40) for _ in range(2)]  # each once, in order
        assert all(s.weight_version == 1 for s in out)
        assert f"SGLang worker {victim} failed" in caplog.text
        engine._settle()
        assert engine.procs[victim].starts == 2 and victim in engine.stale  # holds v0 from disk: not in service
        assert victim not in engine.alive

        engine.update_weights(state0, version=2)  # a new group with both engines
        assert sorted(engine.alive) == sorted(engine.urls) and engine._groups_made == 2
        samples = engine.generate([[5 + i, 6] for i in range(8)], params)
        assert all(s.weight_version == 2 for s in samples)
        _recompute_check(dist_pools, state0, samples, 0.8)
    finally:
        engine.close()
    assert all(not p.running() for p in engine.procs.values())


def weight_transfer_buckets(state, size):
    from megatron_pdm.rollout.weight_transfer import buckets

    return buckets(state, size)


@pytest.mark.skipif(not __import__("megatron_pdm.rollout.launcher", fromlist=["x"]).router_available(),
                    reason="sglang-router not installed")
def test_tensor_sync_behind_sglang_router(dist_pools, tmp_path):
    """Colocated weight handover through shared memory (/update_weights_from_tensor), requests through a real
    sglang-router, and a killed engine restarted and added back to the router."""
    engine = _launched(tmp_path, 2, weight_sync="tensor", router=True, bucket_bytes=16384)
    try:
        engine.update_weights(canonical_hf_state(hf_model(DENSE, seed=41).state_dict()), version=0)
        assert engine.router is not None and sorted(engine.router.workers()) == sorted(engine.urls)
        state = canonical_hf_state(hf_model(DENSE, seed=42).state_dict())
        engine.update_weights(state, version=1)
        params = SamplingParams(max_new_tokens=4, n=2, temperature=1.0, top_k_logprobs=3, seed=4)
        samples = engine.generate([[5 + i, 6] for i in range(12)], params)
        assert all(s.weight_version == 1 for s in samples)
        _recompute_check(dist_pools, state, samples, 1.0)

        engine.update_weights(state, version=2)
        victim = engine.urls[0]
        engine.procs[victim].proc.kill()
        out = engine.generate([[5 + i % 20, 6] for i in range(30)], params)
        assert [s.prompt_index for s in out] == [i for i in range(30) for _ in range(2)]
        engine._settle()  # restarted from the last export (v000000): back in service at the next update
        engine.update_weights(state, version=3)
        assert sorted(engine.alive) == sorted(engine.urls) and sorted(engine.router.workers()) == sorted(engine.urls)
        assert all(s.weight_version == 3 for s in engine.generate([[7, 8]] * 4, params))
    finally:
        engine.close()


def test_trainer_launches_its_own_engines(dist_pools, tmp_path):
    """rollout.num_engines: the trainer starts `megatron-pdm serve` engines from its first weights, hands them
    each update by broadcast, and stops them when the run ends."""
    from megatron_pdm.train.config import config_from_dict
    from tests.test_train import _cfg

    save_hf_checkpoint(tmp_path / "init", canonical_hf_state(hf_model(DENSE, seed=21).state_dict()), DENSE)
    d = _cfg(DENSE.__dict__, {}, tmp_path / "init", steps=2, warm_start_steps=5).to_dict()
    d["rollout"].update(engine="sglang", num_engines=2, server="megatron-pdm", weight_sync="distributed")
    rows = dist_pools(1).run(rank_train, shared=(config_from_dict(d), str(tmp_path / "run")))[0]
    assert [r["step"] for r in rows] == [0, 1, 2] and all("train/reward" in r for r in rows[1:])
    logs = sorted((tmp_path / "run" / "logs").glob("engine-*.log"))
    assert [p.name for p in logs] == ["engine-0.log", "engine-1.log"]
    assert [p.name for p in (tmp_path / "run" / "weights").iterdir()] == ["v000000"]  # later versions: broadcast
    assert not [p for p in Path("/proc").glob("[0-9]*/cmdline")  # the engines stopped with the run
                if f"{tmp_path}/run/weights".encode() in _read(p)]


def _read(path):
    try:
        return path.read_bytes()
    except OSError:  # a process that exited meanwhile
        return b""


def test_routed_experts_and_truncated_sampling_through_the_server(tmp_path, caplog):
    """return_routed_experts travels as SGLang encodes it (base64 int32 [tokens - 1, layers, top_k]) and equals
    what the same engine returns in process; top_p / top_k are sent through with a loud warning."""
    from megatron_pdm.rollout import EmbeddedEngine
    from megatron_pdm.rollout.launcher import LaunchSpec
    from tests.test_models import MOE

    spec = LaunchSpec(server="megatron-pdm", num_engines=1, dtype="float32", log_dir=tmp_path / "logs")
    engine = SGLangEngine((), MOE, weight_dir=tmp_path / "weights", launch=spec, timeout=30)
    local = EmbeddedEngine(MOE)
    try:
        state = canonical_hf_state(hf_model(MOE, seed=8).state_dict())
        engine.update_weights(state, version=0)
        local.update_weights(state, version=0)
        params = SamplingParams(max_new_tokens=4, n=1, top_k_logprobs=2, seed=9, return_routed_experts=True)
        prompts = [[5, 6, 7], [8, 9]]
        remote = engine.generate(prompts, params)
        for i, s in enumerate(remote):  # one request per prompt, seeded as the client seeds it
            mine = local.generate([prompts[i]], SamplingParams(**{**params.__dict__, "seed": 9 * 1_000_003 + i}))[0]
            assert torch.equal(s.response_ids, mine.response_ids)
            assert torch.equal(s.routed_experts, mine.routed_experts) and s.routed_experts.dtype == torch.int32
        with caplog.at_level("WARNING"):
            out = engine.generate(prompts, SamplingParams(max_new_tokens=4, top_k_logprobs=2, top_k=1, seed=1))
        assert "top_k=1" in caplog.text and "biased" in caplog.text
        for s in out:  # top_k = 1 samples the most likely token; the log-probs stay untruncated (< 0)
            assert torch.equal(s.response_ids, s.topk_ids[:, 0]) and bool((s.token_logprobs < 0).all())
    finally:
        engine.close()


def test_launch_commands_and_rollout_config_errors(caplog):
    from megatron_pdm.rollout.launcher import LaunchSpec
    from megatron_pdm.train.config import config_from_dict

    spec = LaunchSpec(server="sglang", num_engines=2, tp=2, quantization="fp8", kv_cache_dtype="fp8_e4m3",
                      routed_experts=True, memory_saver=True, server_args=("--attention-backend", "fa3"))
    cmd = spec.command(1, "/ckpt/v000003", 30001, 3)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for flag in (["--model-path", "/ckpt/v000003"], ["--port", "30001"], ["--tp-size", "2"], ["--weight-version", "3"],
                 ["--quantization", "fp8"], ["--kv-cache-dtype", "fp8_e4m3"], ["--enable-return-routed-experts"],
                 ["--enable-memory-saver"], ["--attention-backend", "fa3"]):
        assert any(cmd[i : i + len(flag)] == flag for i in range(len(cmd))), flag
    serve = LaunchSpec(server="megatron-pdm", dtype="bfloat16").command(0, "/ckpt", 30002, 0)
    assert serve[1:4] == ["-m", "megatron_pdm.cli", "serve"] and "--dtype" in serve
    with pytest.raises(ValueError, match="rollout.engine_tp: 2: megatron-pdm serve"):
        LaunchSpec(server="megatron-pdm", tp=2)
    with pytest.raises(ValueError, match="rollout.server: 'vllm'"):
        LaunchSpec(server="vllm")

    base = {"rollout": {"engine": "sglang"}}
    cases = [
        ({"urls": ["http://a:1"], "num_engines": 2}, "rollout.num_engines: 2 with rollout.urls"),
        ({"weight_sync": "nfs"}, "rollout.weight_sync: 'nfs'"),
        ({"top_k": 0}, "rollout.top_k: expected -1"),
        ({"top_p": 1.5}, "rollout.top_p: 1.5 must be <= 1"),
        ({"engine": "embedded", "router": True}, "rollout.router: True applies to the sglang engine only"),
        ({"routed_experts": True}, "rollout.routed_experts: true, but the model has no MoE layers"),
    ]
    for rollout, msg in cases:
        with pytest.raises(ValueError, match=msg):
            config_from_dict({"rollout": {**base["rollout"], **rollout}})
    with caplog.at_level("WARNING"):
        config_from_dict({"rollout": {"top_p": 0.95}})
    assert "rollout.top_p=0.95" in caplog.text and "truncated sampling" in caplog.text


def test_fp8_rollout_engines_get_block_fp8_weights_by_every_transport(tmp_path):
    """FP8 rollout with engines we launch: the export is a block-FP8 checkpoint (float8_e4m3fn weights, 128 x 128
    `_scale_inv` blocks, quantization_config), and the broadcast and shared-tensor transports send the same
    pairs; the engine then samples exactly as an in-process FP8 engine does."""
    import json

    from safetensors import safe_open

    from megatron_pdm.models import load_hf_checkpoint
    from megatron_pdm.precision import fp8_block_dequantize, fp8_block_quantize
    from megatron_pdm.rollout import EmbeddedEngine
    from megatron_pdm.rollout.launcher import LaunchSpec

    spec = LaunchSpec(server="megatron-pdm", num_engines=1, dtype="bfloat16", log_dir=tmp_path / "logs")
    engine = SGLangEngine((), DENSE, weight_dir=tmp_path / "weights", launch=spec, timeout=30, fp8_export=True)
    local = EmbeddedEngine(DENSE, dtype="bfloat16", quantization="fp8")
    params = SamplingParams(max_new_tokens=5, n=2, top_k_logprobs=3, seed=3)
    try:
        for version, sync in enumerate(("disk", "distributed", "tensor", "disk")):
            engine.weight_sync = sync
            state = canonical_hf_state(hf_model(DENSE, seed=50 + version).state_dict())
            engine.update_weights(state, version=version)
            local.update_weights(state, version=version)
            for i, s in enumerate(engine.generate([[5, 6, 7], [8, 9]], params)):
                p = i // 2
                mine = local.generate([[[5, 6, 7], [8, 9]][p]],
                                      SamplingParams(**{**params.__dict__, "seed": 3 * 1_000_003 + p}))[i % 2]
                assert torch.equal(s.response_ids, mine.response_ids), sync
                torch.testing.assert_close(s.token_logprobs, mine.token_logprobs, atol=0, rtol=0)
    finally:
        engine.close()
    v0 = tmp_path / "weights" / "v000000"
    assert json.loads((v0 / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    with safe_open(str(v0 / "model.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.0.mlp.up_proj.weight")
        assert q.dtype == torch.float8_e4m3fn and "model.layers.0.mlp.up_proj.weight_scale_inv" in f.keys()
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32  # not a linear layer's weight
    loaded, _ = load_hf_checkpoint(v0)  # dequantized: exactly the weights the FP8 engine holds
    w = canonical_hf_state(hf_model(DENSE, seed=50).state_dict())["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(loaded["model.layers.0.mlp.up_proj.weight"], fp8_block_dequantize(*fp8_block_quantize(w),
                                                                                          torch.float32))


def test_close_during_a_restart_leaves_no_server(tmp_path):
    engine = _launched(tmp_path, 1)
    engine.update_weights(canonical_hf_state(hf_model(DENSE, seed=60).state_dict()), version=0)
    (url,) = engine.urls
    engine.procs[url].proc.kill()
    engine.procs[url].proc.wait()
    engine._check_launched()  # schedules the restart in the background
    assert url in engine._restarts
    engine.close()
    time.sleep(3)  # a restart that was under way must not have started a server after close
    assert not [p for p in Path("/proc").glob("[0-9]*/cmdline") if f"{tmp_path}/weights".encode() in _read(p)]
