"""The SGLangEngine client against real `megatron-pdm serve` workers on loopback (SGLang's API, CPU engine)."""

import concurrent.futures
import contextlib
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_pdm.models import canonical_hf_state, save_hf_checkpoint
from megatron_pdm.rollout import SamplingParams
from megatron_pdm.rollout.sglang import transports
from megatron_pdm.rollout.sglang.client import SGLangEngine
from megatron_pdm.rollout.sglang.wire import parse_generate_output
from tests.helpers import (
    DENSE,
    _in_process_server,
    _poll,
    _serve_processes,
    _stop,
    hf_model,
    rank_engine_check,
    sglang_section,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def workers(tmp_path):
    """Two serve processes on free loopback ports, stopped (only those) at the end."""
    procs, urls, state = _serve_processes(tmp_path, 2)
    engine = SGLangEngine(sglang_section(urls=urls, timeout_s=30, retries=1), DENSE, weight_dir=tmp_path / "weights",
                          backoff=0.1)
    engine.wait_ready(120)
    yield engine, procs, state
    _stop(procs)


@pytest.mark.e2e
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
    assert engine.health() and len(engine.pool.alive) == 2
    with pytest.raises(ValueError, match="HTTP 400.*memory released"):
        engine.generate(prompts, params)
    new_state = canonical_hf_state(hf_model(DENSE, seed=22).state_dict())
    engine.update_weights(new_state, version=2)  # resumes the memory first
    assert not engine.pool.released
    samples = engine.generate(prompts, params)
    assert all(s.weight_version == 2 for s in samples)
    recomputed = dist_pools(1).run(rank_engine_check, shared=(DENSE, 1, new_state, 0.7, samples))[0]
    for s, (lp, _) in zip(samples, recomputed, strict=True):
        torch.testing.assert_close(s.token_logprobs, lp, atol=1e-4, rtol=1e-4)

    # kill one worker mid-rollout: every prompt is answered exactly once, by the survivor
    many = [[5 + i % 20, 6] for i in range(40)]
    with _killed_at_first_answer(engine, procs[1].kill):
        out = engine.generate(many, SamplingParams(max_new_tokens=8, n=2, top_k_logprobs=3, seed=1))
    assert [s.prompt_index for s in out] == [i for i in range(40) for _ in range(2)]
    assert len(engine.pool.alive) == 1
    with pytest.raises(ValueError, match="HTTP 400.*input_ids"):
        from megatron_pdm.rollout.sglang.pool import post as _post

        _post(engine.pool.alive[0], "/generate", {"input_ids": [], "sampling_params": {}}, 10)


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
        # the regression (issue 49's siblings): an OverflowError and a TypeError traceback, not a named field
        ({"meta_info": {"output_token_logprobs": [[-(10**400), 3, None]],
                        "output_top_logprobs": [[[-0.5, 3, None], [-1, 4, None]]]}},
         r"output_token_logprobs\[0\]: expected \[logprob, id, text\]"),
        ({"meta_info": {"output_token_logprobs": [[-0.5, 3, None]],
                        "output_top_logprobs": [[[-0.5, 3, None], 7]]}},
         r"output_top_logprobs\[0\]\[1\]: expected \[logprob, id, text\], got 7"),
        ({"meta_info": {"output_token_logprobs": [[-0.5, 3, None]],
                        "output_top_logprobs": [[[-0.5, 3, None], [-1, "x", None]]]}},
         r"output_top_logprobs\[0\]\[1\]: expected"),
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
    from megatron_pdm.train.trainer import Trainer

    trainer = Trainer(cfg, Path(run_dir))
    rows = trainer.run()
    trainer.parallel.close()
    return rows


@pytest.mark.e2e
def test_trainer_rolls_out_through_sglang_workers(dist_pools, workers, tmp_path):
    from tests.helpers import train_cfg

    engine, _, _ = workers
    cfg = train_cfg(DENSE.__dict__, {}, tmp_path / "init", steps=2, warm_start_steps=5)
    d = cfg.to_dict()
    d["rollout"].update(engine="sglang", sglang={**d["rollout"]["sglang"], "urls": list(engine.pool.urls)})
    from megatron_pdm.train.config import config_from_dict

    rows = dist_pools(1).run(rank_train, shared=(config_from_dict(d), str(tmp_path / "run")))[0]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # the default disk sync keeps the export a restart would load, never one a step (a full model each): regression
    assert sorted(p.name for p in (tmp_path / "run" / "weights").iterdir()) == ["v000002"]


@pytest.mark.e2e
def test_trainer_at_pp2_broadcasts_each_stage_to_sglang_workers(dist_pools, tmp_path):
    """The user's path at PP = 2 under distributed sync: each stage's sender has its own weights group with the
    engines, made once for the run (the Learner's `WeightSync` keeps stage 1's across syncs) and destroyed at its
    end; every sync runs in one weight-update session."""
    from megatron_pdm.rollout.sglang.pool import request
    from megatron_pdm.train.config import config_from_dict
    from tests.helpers import train_cfg

    procs, urls, _ = _serve_processes(tmp_path, 2, MEGATRON_PDM_SERVE_TEST_HOOKS="1")
    try:
        d = train_cfg(DENSE.__dict__, {"pipeline": 2}, tmp_path / "init", steps=2).to_dict()
        d["rollout"].update(engine="sglang", sglang={**d["rollout"]["sglang"], "urls": urls,
                                                     "weight_sync": "distributed"})
        rows = dist_pools(2).run(rank_train, shared=(config_from_dict(d), str(tmp_path / "run")))[0]
        received = [request(url, "/megatron_pdm/faults", None, 10)["received"] for url in urls]
    finally:
        _stop(procs)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in received:  # three syncs (start, steps 1 and 2), two groups for the run, both destroyed at its end
        assert r["/init_weights_update_group"] == r["/destroy_weights_update_group"] == 2, r
        assert r["/begin_weight_update"] == r["/end_weight_update"] == 3, r


def _recompute_check(dist_pools, state, samples, temperature):
    recomputed = dist_pools(1).run(rank_engine_check, shared=(DENSE, 1, state, temperature, samples))[0]
    for s, (lp, top) in zip(samples, recomputed, strict=True):
        torch.testing.assert_close(s.token_logprobs, lp, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s.topk_logprobs, top, atol=1e-4, rtol=1e-4)


@contextlib.contextmanager
def _killed_at_first_answer(engine, kill):
    """kill() runs once, as `engine` reads the first answer of a generate: with 40 requests for 2 engines x 16
    slots, the worker it kills then has requests in flight or queued for it (a timer's kill raced the rollout)."""
    real_parser, killed = engine._parser, []

    def parser(*args):
        parse = real_parser(*args)

        def parse_first_kills(out, i):
            if not killed:
                killed.append(i)
                kill()
            return parse(out, i)
        return parse_first_kills

    engine._parser = parser
    try:
        yield
    finally:
        engine._parser = real_parser
    assert killed


def _launched(tmp_path, num_engines, **rollout):
    from megatron_pdm.rollout.sglang.launcher import LaunchSpec

    spec = LaunchSpec(server="megatron-pdm", num_engines=num_engines, dtype="float32", log_dir=tmp_path / "logs",
                      startup_timeout_s=120)
    return SGLangEngine(sglang_section(timeout_s=30, retries=1, **rollout), DENSE, weight_dir=tmp_path / "weights",
                        launch=spec, backoff=0.1)


@pytest.mark.e2e
def test_launched_engines_distributed_sync_and_restart(dist_pools, tmp_path, caplog):
    """Engines we launch: weights by broadcast over a gloo group of the trainer and both engines; a killed
    engine is restarted from the last disk export while its prompts go to the other, and rejoins the group at
    the next update. The trainer runs under torchrun's environment, which the engines do not inherit (with
    TORCHELASTIC_USE_AGENT_STORE their rendezvous would wait for a store nobody serves: the broadcast never
    starts)."""
    torchrun = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "x", "RANK": "3", "LOCAL_RANK": "3",
                "WORLD_SIZE": "8", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    engine = _launched(tmp_path, 2, weight_sync="distributed", sync_bucket_bytes=4096)
    try:
        state0 = canonical_hf_state(hf_model(DENSE, seed=31).state_dict())
        with pytest.MonkeyPatch.context() as mp:  # only while they start: the test's gloo pools must not see it
            for k, v in torchrun.items():
                mp.setenv(k, v)
            engine.update_weights(state0, version=0)  # starts both from the export v000000
        assert len(engine.pool.alive) == 2 and engine.pool.export[1] == 0
        for p in engine.pool.procs.values():
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{p.proc.pid}/environ").read_bytes().split(b"\0")
                       if b"=" in kv)
            assert not {k.encode() for k in torchrun} & set(env) and b"PATH" in env
        state1 = canonical_hf_state(hf_model(DENSE, seed=32).state_dict())
        engine.update_weights(state1, version=1)  # broadcast, in buckets of <= 4 KiB
        assert engine.transports["distributed"].group is not None and len(weight_transfer_buckets(state1, 4096)) > 3
        params = SamplingParams(max_new_tokens=4, n=2, temperature=0.8, top_k_logprobs=3, seed=3)
        samples = engine.generate([[5, 6, 7], [8, 9]], params)
        assert all(s.weight_version == 1 for s in samples)
        _recompute_check(dist_pools, state1, samples, 0.8)

        victim = engine.pool.alive[1]
        many = [[5 + i % 20, 6] for i in range(40)]
        with caplog.at_level("WARNING"), _killed_at_first_answer(engine, engine.pool.procs[victim].proc.kill):
            out = engine.generate(many, SamplingParams(max_new_tokens=8, n=2, top_k_logprobs=3, seed=1))
        assert [s.prompt_index for s in out] == [i for i in range(40) for _ in range(2)]  # each once, in order
        assert all(s.weight_version == 1 for s in out)
        assert f"SGLang worker {victim} failed" in caplog.text
        engine._settle()
        # holds v0 from disk: not in service
        assert engine.pool.procs[victim].starts == 2 and victim in engine.pool.stale
        assert victim not in engine.pool.alive

        engine.update_weights(state0, version=2)  # a new group with both engines
        assert sorted(engine.pool.alive) == sorted(engine.pool.urls)
        assert engine.transports["distributed"].groups_made == 2
        samples = engine.generate([[5 + i, 6] for i in range(8)], params)
        assert all(s.weight_version == 2 for s in samples)
        _recompute_check(dist_pools, state0, samples, 0.8)
    finally:
        engine.close()
    assert all(not p.running() for p in engine.pool.procs.values())


def weight_transfer_buckets(state, size):
    from megatron_pdm.rollout.sglang.weight_transfer import buckets

    return buckets(state, size)


@pytest.mark.skipif(not __import__("megatron_pdm.rollout.sglang.launcher", fromlist=["x"]).router_available(),
                    reason="sglang-router not installed")
@pytest.mark.e2e
def test_tensor_sync_behind_sglang_router(dist_pools, tmp_path):
    """Colocated weight handover through shared memory (/update_weights_from_tensor), requests through a real
    sglang-router, and a killed engine restarted and added back to the router."""
    engine = _launched(tmp_path, 2, weight_sync="tensor", router=True, sync_bucket_bytes=16384)
    try:
        engine.update_weights(canonical_hf_state(hf_model(DENSE, seed=41).state_dict()), version=0)
        assert engine.pool.router is not None and sorted(engine.pool.router.workers()) == sorted(engine.pool.urls)
        state = canonical_hf_state(hf_model(DENSE, seed=42).state_dict())
        engine.update_weights(state, version=1)
        params = SamplingParams(max_new_tokens=4, n=2, temperature=1.0, top_k_logprobs=3, seed=4)
        samples = engine.generate([[5 + i, 6] for i in range(12)], params)
        assert all(s.weight_version == 1 for s in samples)
        _recompute_check(dist_pools, state, samples, 1.0)

        engine.update_weights(state, version=2)
        victim = engine.pool.urls[0]
        engine.pool.procs[victim].proc.kill()
        out = engine.generate([[5 + i % 20, 6] for i in range(30)], params)
        assert [s.prompt_index for s in out] == [i for i in range(30) for _ in range(2)]
        engine._settle()  # restarted from the last export (v000000): back in service at the next update
        engine.update_weights(state, version=3)
        pool = engine.pool
        assert sorted(pool.alive) == sorted(pool.urls) and sorted(pool.router.workers()) == sorted(pool.urls)
        assert all(s.weight_version == 3 for s in engine.generate([[7, 8]] * 4, params))
    finally:
        engine.close()


def test_trainer_launches_its_own_engines(dist_pools, tmp_path):
    """rollout.sglang.num_engines: the trainer starts `megatron-pdm serve` engines from its first weights, hands them
    each update by broadcast, and stops them when the run ends."""
    from megatron_pdm.train.config import config_from_dict
    from tests.helpers import train_cfg

    save_hf_checkpoint(tmp_path / "init", canonical_hf_state(hf_model(DENSE, seed=21).state_dict()), DENSE)
    d = train_cfg(DENSE.__dict__, {}, tmp_path / "init", steps=2, warm_start_steps=5).to_dict()
    d["rollout"].update(engine="sglang", sglang={**d["rollout"]["sglang"], "num_engines": 2, "server": "megatron-pdm",
                                                 "weight_sync": "distributed"})
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


@pytest.mark.e2e
def test_routed_experts_and_truncated_sampling_through_the_server(tmp_path, caplog):
    """return_routed_experts travels as SGLang encodes it (base64 int32 [tokens - 1, layers, top_k]) and equals
    what the same engine returns in process, also with sglang-router installed: 0.3.2 drops the flag from the
    requests it forwards (checked against it), so these requests go to the engines directly; top_p / top_k are
    sent through with a loud warning."""
    from megatron_pdm.rollout import EmbeddedEngine
    from megatron_pdm.rollout.sglang.launcher import LaunchSpec, router_available
    from tests.helpers import MOE

    spec = LaunchSpec(server="megatron-pdm", num_engines=1, dtype="float32", log_dir=tmp_path / "logs")
    engine = SGLangEngine(sglang_section(timeout_s=30, router=router_available()), MOE,
                          weight_dir=tmp_path / "weights", launch=spec)
    local = EmbeddedEngine(MOE)
    try:
        state = canonical_hf_state(hf_model(MOE, seed=8).state_dict())
        engine.update_weights(state, version=0)
        local.update_weights(state, version=0)
        params = SamplingParams(max_new_tokens=4, n=1, top_k_logprobs=2, seed=9, return_routed_experts=True)
        prompts = [[5, 6, 7], [8, 9]]
        assert (engine.pool.router is not None) == router_available()
        remote = engine.generate(prompts, params)
        # one request per sample, seeded per sample: what the same engine draws in process for the whole call
        for s, mine in zip(remote, local.generate(prompts, params), strict=True):
            assert torch.equal(s.response_ids, mine.response_ids) and s.seed == mine.seed
            assert torch.equal(s.routed_experts, mine.routed_experts) and s.routed_experts.dtype == torch.int32
        with caplog.at_level("WARNING"):
            out = engine.generate(prompts, SamplingParams(max_new_tokens=4, top_k_logprobs=2, top_k=1, seed=1))
        assert "top_k=1" in caplog.text and "biased" in caplog.text
        for s in out:  # top_k = 1 samples the most likely token; the log-probs stay untruncated (< 0)
            assert torch.equal(s.response_ids, s.topk_ids[:, 0]) and bool((s.token_logprobs < 0).all())
    finally:
        engine.close()


def test_launch_commands_and_rollout_config_errors(caplog):
    from megatron_pdm.rollout.sglang.launcher import LaunchSpec
    from megatron_pdm.train.config import config_from_dict

    spec = LaunchSpec(server="sglang", num_engines=2, tp=2, quantization="fp8", kv_cache_dtype="fp8_e4m3",
                      routed_experts=True, memory_saver=True, server_args=("--attention-backend", "fa3"))
    cmd = spec.command(1, "/ckpt/v000003", 30001, 3)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for flag in (["--model-path", "/ckpt/v000003"], ["--port", "30001"], ["--tp-size", "2"], ["--weight-version", "3"],
                 ["--quantization", "fp8"], ["--kv-cache-dtype", "fp8_e4m3"], ["--enable-return-routed-experts"],
                 ["--enable-memory-saver"], ["--attention-backend", "fa3"]):
        assert any(cmd[i : i + len(flag)] == flag for i in range(len(cmd))), flag
    assert "--trust-remote-code" not in cmd  # regression: code a checkpoint names ran in every engine, unasked
    serve = LaunchSpec(server="megatron-pdm", dtype="bfloat16").command(0, "/ckpt", 30002, 0)
    assert serve[1:4] == ["-m", "megatron_pdm.cli", "serve"] and "--dtype" in serve
    with pytest.raises(ValueError, match="rollout.sglang.engine_tp: 2: megatron-pdm serve"):
        LaunchSpec(server="megatron-pdm", tp=2)
    with pytest.raises(ValueError, match="rollout.sglang.server: 'vllm'"):
        LaunchSpec(server="vllm")

    base = {"rollout": {"engine": "sglang"}}
    cases = [
        ({"sglang": {"urls": ["http://a:1"], "num_engines": 2}},
         "rollout.sglang.num_engines: 2 with rollout.sglang.urls"),
        ({"sglang": {"weight_sync": "nfs"}}, "rollout.sglang.weight_sync: 'nfs'"),
        ({"top_k": 0}, "rollout.top_k: expected -1"),
        ({"top_p": 1.5}, "rollout.top_p: 1.5 must be <= 1"),
        ({"engine": "embedded", "sglang": {"router": True}},
         "rollout.sglang.router: True applies to the sglang engine only"),
        ({"routed_experts": True}, "rollout.routed_experts: true, but the model has no MoE layers"),
        # /release_memory_occupation kills a CPU SGLang server (0.5.23): refused at load
        ({"sglang": {"num_engines": 1, "release_memory": True, "server_args": ["--device", "cpu"]}},
         "rollout.sglang.release_memory: true with SGLang engines on a CPU"),
    ]
    for rollout, msg in cases:
        with pytest.raises(ValueError, match=msg):
            config_from_dict({"rollout": {**base["rollout"], **rollout}})
    with caplog.at_level("WARNING"):
        config_from_dict({"rollout": {"top_p": 0.95}})
    assert "rollout.top_p=0.95" in caplog.text and "truncated sampling" in caplog.text
    # layouts whose weight sync cannot reach the engines, refused at load (and so by plan and submit)
    from megatron_pdm.train.config import load_config

    preset = ROOT / "examples" / "presets" / "qwen3_8b.yaml"  # 1 node, engines colocated
    with pytest.raises(ValueError, match="'distributed' with the engines colocated .* shares the GPU of the "
                                         "trainer's rank 0"):
        load_config(preset, ["rollout.sglang.weight_sync=distributed"])
    with pytest.raises(ValueError, match="'tensor' with engines on 1 node.s. of their own: it hands CUDA IPC"):
        load_config(preset, ["rollout.sglang.weight_sync=tensor", "cluster.nodes=2", "cluster.rollout_nodes=1"])
    with pytest.raises(ValueError, match="'tensor' with engines on all 2 training nodes"):
        load_config(preset, ["rollout.sglang.weight_sync=tensor", "cluster.nodes=2"])
    assert load_config(preset, ["rollout.sglang.weight_sync=tensor"]).rollout.sglang.weight_sync == "tensor"  # one node


# the smallest Qwen3 that SGLang can load as block-FP8: q / k / v and gate / up shards of 128 (precision.py)
FP8_DENSE = DENSE.__class__(vocab_size=320, hidden_size=128, num_layers=2, num_attention_heads=2, num_query_groups=2,
                            head_dim=64, ffn_hidden_size=128, max_position_embeddings=64)


@pytest.mark.e2e
def test_fp8_rollout_engines_get_block_fp8_weights_by_every_transport(tmp_path):
    """FP8 rollout with engines we launch: the export is a block-FP8 checkpoint (float8_e4m3fn weights, 128 x 128
    `_scale_inv` blocks, quantization_config, the rest in the rollout dtype), and the broadcast and shared-tensor
    transports send the same pairs (serve, like SGLang's FP8 engines, refuses plain weights); the engine then
    samples exactly as an in-process FP8 engine does."""
    import json

    from safetensors import safe_open

    from megatron_pdm.models import load_hf_checkpoint
    from megatron_pdm.precision import fp8_block_dequantize, fp8_block_quantize
    from megatron_pdm.rollout import EmbeddedEngine
    from megatron_pdm.rollout.sglang.launcher import LaunchSpec

    spec = LaunchSpec(server="megatron-pdm", num_engines=1, dtype="bfloat16", log_dir=tmp_path / "logs")
    engine = SGLangEngine(sglang_section(timeout_s=30), FP8_DENSE, weight_dir=tmp_path / "weights", launch=spec,
                          quantization="fp8", dtype="bfloat16")
    local = EmbeddedEngine(FP8_DENSE, dtype="bfloat16", quantization="fp8")
    params = SamplingParams(max_new_tokens=5, n=2, top_k_logprobs=3, seed=3)
    prompts = [[5, 6, 7], [8, 9]]
    try:
        for version, sync in enumerate(("disk", "distributed", "tensor", "disk")):
            engine.weight_sync = sync
            state = canonical_hf_state(hf_model(FP8_DENSE, seed=50 + version).state_dict())
            engine.update_weights(state, version=version)
            local.update_weights(state, version=version)
            for k, s in enumerate(engine.generate(prompts, params)):  # each sample from its own seed
                p, j = divmod(k, 2)
                seed = SGLangEngine.sample_seeds(params, p)[j]
                mine = local.generate([prompts[p]], SamplingParams(**{**params.__dict__, "n": 1, "seed": seed}))[0]
                assert torch.equal(s.response_ids, mine.response_ids), sync
                torch.testing.assert_close(s.token_logprobs, mine.token_logprobs, atol=0, rtol=0)
    finally:
        engine.close()
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v000003"]  # the replaced exports deleted
    v0 = tmp_path / "weights" / "v000003"
    config = json.loads((v0 / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128] and config["torch_dtype"] == "bfloat16"
    with safe_open(str(v0 / "model.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.0.mlp.up_proj.weight")
        assert q.dtype == torch.float8_e4m3fn and "model.layers.0.mlp.up_proj.weight_scale_inv" in f.keys()
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight_scale_inv").dtype == torch.float32
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16  # not a linear layer's weight
    loaded, _ = load_hf_checkpoint(v0)  # dequantized: exactly the weights the FP8 engine holds
    w = canonical_hf_state(hf_model(FP8_DENSE, seed=53).state_dict())["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(loaded["model.layers.0.mlp.up_proj.weight"], fp8_block_dequantize(*fp8_block_quantize(w),
                                                                                          torch.float32))


@pytest.mark.e2e
def test_close_during_a_restart_leaves_no_server(tmp_path):
    engine = _launched(tmp_path, 1)
    engine.update_weights(canonical_hf_state(hf_model(DENSE, seed=60).state_dict()), version=0)
    (url,) = engine.pool.urls
    engine.pool.procs[url].proc.kill()
    engine.pool.procs[url].proc.wait()
    engine._check_launched()  # schedules the restart in the background
    restart = engine.pool.restarts[url]
    engine.close()
    # a restart that was under way must not have started a server after close: once it has ended (cancelled, or
    # stopped by close), nothing else can start one
    concurrent.futures.wait([restart], timeout=60)
    assert restart.done()
    assert not [p for p in Path("/proc").glob("[0-9]*/cmdline") if f"{tmp_path}/weights".encode() in _read(p)]


# -- real SGLang compatibility: process group, failures, seeds, quantization, command lines ------------------------
SGLANG_DATA = ROOT / "tests" / "data" / "sglang"


def _sglang_engine_rank(port, rank, world, name, shapes, timeout_s, queue):
    """One engine rank built the way SGLang 0.5.23 builds it, re-implemented here from its source:
    WeightUpdater.init_weights_update_group -> init_custom_process_group(backend, init_method="tcp://addr:port",
    world_size, rank=rank_offset + tp_rank, group_name): rendezvous's TCPStore (rank 0 hosts it), set_timeout,
    PrefixStore(group_name), torch's _new_process_group_helper, an identity rank map; then, per announced tensor of
    /update_weights_from_distributed, dist.broadcast(torch.empty(shape, dtype), src=0, group, async_op=True)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    try:
        timeout = timedelta(seconds=timeout_s)
        store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", rank, world, timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(name, store)
        pg, _ = _new_process_group_helper(world, rank, [], Backend("gloo"), store, group_name=name,
                                          backend_options=None, timeout=timeout)
        _world.pg_group_ranks[pg] = {i: i for i in range(world)}
        got = []
        handles = []
        for dtype, shape in shapes:
            got.append(torch.empty(shape, dtype=getattr(torch, dtype)))
            handles.append(dist.broadcast(got[-1], src=0, group=pg, async_op=True))
        for h in handles:
            h.wait()
        queue.put((rank, [t.float().tolist() for t in got]))
    except Exception as e:  # the test reads the failure
        queue.put((rank, f"{type(e).__name__}: {e}"))


def _engine_ranks(port, world, name, shapes, timeout_s):
    """The engine's ranks 1 .. world - 1, forked from the test pools' preloaded server (they start in ~0.3 s)."""
    from tests.distributed import _context

    ctx = _context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_sglang_engine_rank, args=(port, r, world, name, shapes, timeout_s, queue))
             for r in range(1, world)]
    for p in procs:
        p.start()
    return procs, queue


@pytest.mark.e2e
def test_trainer_group_meets_sglangs_engine_construction():
    """The trainer's side of the weights group (rank 0) and an engine of TP 2 built as SGLang builds it meet: the
    broadcast arrives, and every rank's address went into the store under the same prefixes (group name, then
    torch's group name / and device / layers). The old construction (a bare ProcessGroupGloo over
    PrefixStore(group name)) never meets SGLang's side."""
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_pdm.rollout.sglang import weight_transfer
    from megatron_pdm.rollout.sglang.launcher import free_port

    sent = [torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16), torch.arange(5.0)]
    shapes = [(weight_transfer.dtype_name(t.dtype), list(t.shape)) for t in sent]
    port, name = free_port(), "megatron-pdm-test-group"
    procs, queue = _engine_ranks(port, 3, name, shapes, 60)
    try:
        pg = weight_transfer.custom_process_group("127.0.0.1", port, 0, 3, name, backend="gloo", timeout_s=60)
        weight_transfer.broadcast_tensors(pg, sent)
        got = dict(queue.get(timeout=60) for _ in procs)
        assert sorted(got) == [1, 2]
        for rank, tensors in got.items():
            assert not isinstance(tensors, str), tensors
            for t, g in zip(sent, tensors, strict=True):
                assert torch.equal(t.float(), torch.tensor(g)), rank
        raw = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=10))
        keys = raw.list_keys()
        prefix = f"{name}/{name}//cpu//"  # PrefixStore(name) / PrefixStore(name/) / PrefixStore(cpu/)
        assert keys and all(k.startswith(prefix) for k in keys), keys
        assert {k.rsplit("/", 1)[-1] for k in keys} == {"0", "1", "2"}  # every rank, trainer included
        weight_transfer.destroy_group(pg)
    finally:
        for p in procs:
            p.join(timeout=30)

    # before: TCPStore + PrefixStore(group name) + ProcessGroupGloo: the keys never meet, both sides time out
    port, name = free_port(), "megatron-pdm-test-old"
    procs, queue = _engine_ranks(port, 2, name, shapes[:1], 4)
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=60))
        with pytest.raises(RuntimeError):
            dist.ProcessGroupGloo(dist.PrefixStore(name, store), 0, 2, timedelta(seconds=2))
        rank, result = queue.get(timeout=30)
        assert isinstance(result, str), result  # the SGLang side timed out too
    finally:
        for p in procs:
            p.join(timeout=30)


def test_trainer_address_is_reachable(monkeypatch):
    from megatron_pdm.rollout.sglang.weight_transfer import MASTER_ADDRESS_ENV, trainer_address

    monkeypatch.delenv(MASTER_ADDRESS_ENV, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "node-17")
    assert trainer_address(["http://127.0.0.1:30000", "http://localhost:30001"]) == "127.0.0.1"
    assert trainer_address(["http://node-3:30000"]) == "node-17"  # the rendezvous host, where rank 0 runs
    assert trainer_address(["http://node-3:30000"], "10.0.0.5") == "10.0.0.5"
    monkeypatch.setenv(MASTER_ADDRESS_ENV, "10.0.0.6")
    assert trainer_address(["http://node-3:30000"]) == "10.0.0.6"
    monkeypatch.delenv(MASTER_ADDRESS_ENV)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # a loopback MASTER_ADDR does not reach other hosts
    addr = trainer_address(["http://10.255.255.1:30000"])  # the route's local address (or the host's name)
    assert addr and addr != "127.0.0.1"


# SGLang's /generate responses: hand-written from its source, recorded by the real CPU tier
# (tests/rollout/test_sglang_real.py), and recorded on a GPU when a GPU run wrote one (tests/gpu/test_sglang_engine.py)
SGLANG_FIXTURES = [f for f in ("generate_handwritten.json", "generate_recorded_cpu.json", "generate_recorded.json")
                   if (SGLANG_DATA / f).is_file()]
# meta_info keys of SGLang's that serve leaves out: its bookkeeping, which the client never reads
SGLANG_ONLY_META = {"id", "num_retractions", "e2e_latency", "reasoning_tokens", "cached_tokens_details", "dp_rank",
                    "response_sent_to_client_ts"}


@pytest.mark.e2e
@pytest.mark.parametrize("fixture", SGLANG_FIXTURES)
def test_sglang_response_fixture_parses_and_serve_answers_in_its_shape(tmp_path, fixture):
    """The client parses SGLang's /generate response (hand-written from its source, recorded from a real SGLang
    0.5.23 on a CPU, or on a GPU); the client's request uses only fields of that request; `serve` answers with the
    same fields (`text` only with a tokenizer, which this serve has not)."""
    import json

    from megatron_pdm.rollout.sglang.wire import AbortedRequest

    fx = json.loads((SGLANG_DATA / fixture).read_text())
    req, resp = fx["request"], fx["response"]
    version = int(resp[0]["meta_info"]["weight_version"])
    K = req["top_logprobs_num"]
    for i, out in enumerate(resp):
        s = parse_generate_output(out, prompt_index=0, prompt_ids=req["input_ids"][i], k=K,
                                  vocab_size=fx["vocab_size"], weight_version=version)
        assert s.response_ids.tolist() == out["output_ids"]
        assert s.finish_reason == ("stop" if out["meta_info"]["finish_reason"]["type"] == "stop" else "length")
        assert s.topk_ids.shape == (len(out["output_ids"]), K)
    n = len(req["input_ids"])
    params = SamplingParams(max_new_tokens=3, n=n, temperature=0.8, top_k_logprobs=K, stop_token_ids=(3,), seed=5)
    ours = SGLangEngine(sglang_section(urls=["http://x"]), DENSE, weight_dir=tmp_path)._request(
        req["input_ids"][0], params,
                                                                              SGLangEngine.sample_seeds(params, 0))
    assert set(ours) <= set(req) and set(ours["sampling_params"][0]) <= set(req["sampling_params"][0])
    seeds = [p["sampling_seed"] for p in ours["sampling_params"]]
    assert seeds[0] == 5 and len(set(seeds)) == n and all(0 <= x < 2**63 for x in seeds)  # one per sample
    # an aborted output (what /pause_generation gives the requests in flight) is never scored
    aborted = json.loads(json.dumps(resp[1]))
    aborted["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort", "status_code": None,
                                             "err_type": None}
    with pytest.raises(AbortedRequest, match="aborted"):
        parse_generate_output(aborted, prompt_index=0, prompt_ids=[5, 6, 7], k=K, vocab_size=fx["vocab_size"],
                              weight_version=version)

    server, url, stop = _in_process_server(tmp_path, DENSE)
    try:
        out = _post(url, "/generate", req, 30)
        assert len(out) == n
        for mine, theirs in zip(out, resp, strict=True):
            assert set(mine) == set(theirs) - {"text"}  # output_ids, meta_info (no text: no tokenizer files)
            missing = set(theirs["meta_info"]) - set(mine["meta_info"]) - SGLANG_ONLY_META
            assert not missing, missing
        info = json.loads(urllib_get(url + "/server_info"))
        assert info["quantization"] is None and info["model_path"] == str(tmp_path / "init")
        assert json.loads(urllib_get(url + "/get_model_info"))["model_path"] == str(tmp_path / "init")
    finally:
        stop()


def urllib_get(url):
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def _post(url, path, body, timeout):
    from megatron_pdm.rollout.sglang.pool import post

    return post(url, path, body, timeout)


def _get_json(url, path):
    from megatron_pdm.rollout.sglang.pool import request

    return request(url, path, None, 10)


@pytest.mark.e2e
def test_pause_generation_aborts_requests_in_flight(tmp_path):
    """`serve` does what SGLang's /pause_generation does: mode "abort" (the default, what the client sends) aborts
    the requests in flight (finish_reason abort); "retract" and "in_place" hold them; new requests wait until
    /continue_generation."""
    server, url, stop = _in_process_server(tmp_path, DENSE)
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "sampling_seed": 1},
            "return_logprob": True, "top_logprobs_num": 2}
    try:
        for mode, aborted in ((None, True), ("retract", False)):
            result = {}
            with server.lock:  # the request gets past the pause gate and waits for the engine
                t = threading.Thread(target=lambda r=result: r.update(out=_post(url, "/generate", body, 60)))
                t.start()
                _poll(lambda: server.inflight == 1, "the request never got in flight")
                _post(url, "/pause_generation", {} if mode is None else {"mode": mode}, 10)
            t.join(timeout=60)
            reason = result["out"]["meta_info"]["finish_reason"]["type"]
            assert (reason == "abort") == aborted, (mode, reason)
            _post(url, "/continue_generation", {}, 10)
        assert _post(url, "/generate", body, 60)["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    finally:
        stop()


@pytest.mark.e2e
def test_each_sample_of_a_group_has_its_own_seed(tmp_path):
    """With one seed for the n copies of a prompt, an engine that honours seeds (serve; SGLang with
    --enable-deterministic-inference) returns n equal samples: the client gives each sample its own."""
    _, url, stop = _in_process_server(tmp_path, DENSE)
    try:
        sp = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7}
        same = _post(url, "/generate", {"input_ids": [[5, 6, 7]] * 4, "sampling_params": sp}, 60)
        assert len({tuple(o["output_ids"]) for o in same}) == 1  # what the old client got
        engine = SGLangEngine(sglang_section(urls=[url], timeout_s=60), DENSE, weight_dir=tmp_path / "w")
        engine.wait_ready(30)
        engine.weight_version = 0
        out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, n=4, top_k_logprobs=2, seed=7))
        assert len({tuple(s.response_ids.tolist()) for s in out}) > 1
        again = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, n=4, top_k_logprobs=2, seed=7))
        assert all(torch.equal(a.response_ids, b.response_ids) for a, b in zip(out, again, strict=True))
    finally:
        stop()


@pytest.fixture
def hooked_workers(tmp_path):
    """Three serve processes with the test hooks (injected update failures and aborted requests)."""
    procs, urls, state = _serve_processes(tmp_path, 3, MEGATRON_PDM_SERVE_TEST_HOOKS="1")
    yield urls, state
    _stop(procs)


@pytest.mark.e2e
def test_failed_updates_drop_the_engine_and_aborted_requests_are_retried(dist_pools, hooked_workers, tmp_path,
                                                                        caplog):
    """A weight update that fails on one engine (HTTP 400, as SGLang answers it) drops that engine with a log line
    and resumes generation on the others, by disk and by broadcast (a new group of the rest gets everything);
    requests an engine aborts are sent again, never scored; the weights travel in the rollout dtype."""
    from safetensors import safe_open

    urls, state = hooked_workers
    engine = SGLangEngine(sglang_section(urls=urls, timeout_s=30, retries=1), DENSE, weight_dir=tmp_path / "weights",
                          backoff=0.1, dtype="bfloat16")
    engine.wait_ready(120)
    assert engine.fp8 is False
    sent = []
    real_broadcast = __import__("megatron_pdm.rollout.sglang.weight_transfer", fromlist=["x"]).start_broadcast

    def spy(pg, tensors):
        sent.extend(t.dtype for t in tensors)
        return real_broadcast(pg, tensors)

    try:
        _post(urls[2], "/megatron_pdm/faults", {"fail_updates": 1}, 10)
        with caplog.at_level("WARNING"):
            engine.update_weights(state, version=1)
        assert engine.pool.alive == urls[:2] and "dropping SGLang worker " + urls[2] in caplog.text
        assert "HTTP 400" in caplog.text
        with safe_open(str(tmp_path / "weights" / "v000001" / "model.safetensors"), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}

        engine.weight_sync = "distributed"
        _post(urls[1], "/megatron_pdm/faults", {"fail_updates": 1}, 10)
        with caplog.at_level("WARNING"), pytest.MonkeyPatch.context() as mp:
            mp.setattr("megatron_pdm.rollout.sglang.weight_transfer.start_broadcast", spy)
            engine.update_weights(state, version=2)
        assert engine.pool.alive == urls[:1] and "dropping SGLang worker " + urls[1] in caplog.text
        # a group of the rest got it all again
        assert engine.transports["distributed"].groups_made == 2 and set(sent) == {torch.bfloat16}
        out = _post(urls[1], "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}, 30)
        assert out["meta_info"]["weight_version"] == "1"  # dropped with version 1, and not left paused

        params = SamplingParams(max_new_tokens=5, n=2, temperature=0.9, top_k_logprobs=3, seed=11)
        prompts = [[5 + i, 6] for i in range(6)]
        reference = engine.generate(prompts, params)
        _post(urls[0], "/megatron_pdm/faults", {"abort_generates": 3}, 10)
        caplog.clear()
        with caplog.at_level("WARNING"):
            retried = engine.generate(prompts, params)
        assert caplog.text.count("aborted (") == 3
        assert [s.prompt_index for s in retried] == [i for i in range(6) for _ in range(2)]
        for a, b in zip(reference, retried, strict=True):  # same seeds, same samples: nothing scored from an abort
            assert torch.equal(a.response_ids, b.response_ids) and a.finish_reason == b.finish_reason
            assert a.weight_version == 2
    finally:
        engine.close()


@pytest.mark.e2e
def test_fp8_engines_are_recognised_and_get_block_fp8_weights(tmp_path):
    """An attached engine started from a block-FP8 checkpoint (fp8_export, as the Slurm script does) says so in
    /server_info and its config.json: the client sends it block-FP8 weights, which it takes, while plain weights are
    refused (HTTP 400, as SGLang's FP8 engines refuse them); a mismatch with precision.rollout, an engine that
    quantizes online and one whose checkpoint is unreadable are errors naming the engine."""
    from megatron_pdm.rollout.sglang.fp8_export import engine_quantization, export_block_fp8
    from megatron_pdm.rollout.sglang.pool import Rejected

    state = canonical_hf_state(hf_model(FP8_DENSE, seed=70).state_dict())
    save_hf_checkpoint(tmp_path / "bf16", state, FP8_DENSE)
    export_block_fp8(tmp_path / "bf16", tmp_path / "fp8")
    _, url, stop = _in_process_server(tmp_path, FP8_DENSE, path=str(tmp_path / "fp8"), dtype="bfloat16")
    try:
        engine = SGLangEngine(sglang_section(urls=[url], timeout_s=30), FP8_DENSE, weight_dir=tmp_path / "weights",
                              quantization="fp8", dtype="bfloat16")
        engine.wait_ready(30)
        assert engine.fp8
        for version, sync in enumerate(("disk", "tensor"), start=1):
            engine.weight_sync = sync
            engine.update_weights(state, version=version)
            assert engine.pool.alive == [url]
        _post(url, "/begin_weight_update", {}, 30)  # 0.5.23 takes tensor updates inside a session only
        with pytest.raises(Rejected, match="HTTP 400.*block-FP8"):
            from megatron_pdm.rollout.sglang import weight_transfer

            named = weight_transfer.shared(list(state.items()))
            _post(url, "/update_weights_from_tensor",
                  {"serialized_named_tensors": [weight_transfer.serialize_named_tensors(named)]}, 30)
        _post(url, "/end_weight_update", {}, 30)
        with pytest.raises(ValueError, match=f"precision.rollout: .*unquantized.*{url} is fp8"):
            SGLangEngine(sglang_section(urls=[url], timeout_s=30), FP8_DENSE,
                         weight_dir=tmp_path / "w2").wait_ready(30)
    finally:
        stop()
    with pytest.raises(ValueError, match="quantizes a bf16 checkpoint to FP8 itself"):
        engine_quantization("http://e:1", "fp8", "/ckpt", {"model_type": "qwen3"})
    with pytest.raises(ValueError, match="cannot tell whether the engine is quantized"):
        engine_quantization("http://e:1", None, "Qwen/Qwen3-8B", None)
    assert engine_quantization("http://e:1", None, "/ckpt", {}) is None


def test_fp8_block_shapes_sglang_refuses_are_named(tmp_path):
    """Qwen3-30B-A3B's experts (768 wide) split into 192 / 96-wide shards at engine TP 4 / 8, which SGLang refuses
    to load as block-FP8: the check names the layer and the TP (and the TPs that work); the FP8 export of a
    checkpoint keeps its files and links one that is block-FP8 already."""
    import json

    from megatron_pdm.precision import check_fp8_block_shapes, fp8_block_shape_error
    from megatron_pdm.rollout.sglang.fp8_export import export_block_fp8
    from megatron_pdm.rollout.sglang.launcher import LaunchSpec
    from megatron_pdm.train.config import load_config

    a3b = load_config(ROOT / "examples" / "presets" / "qwen3_30b_a3b.yaml").model
    assert fp8_block_shape_error(a3b, 1) is None and fp8_block_shape_error(a3b, 2) is None
    for tp, shard in ((4, 192), (8, 96)):
        with pytest.raises(ValueError, match=rf"rollout.sglang.engine_tp: {tp} with precision.rollout fp8: "
                           rf"model.layers.\*.mlp.experts.\*.gate_proj/up_proj: .* 768 / engine TP {tp} = {shard} "
                           r"per shard .*engine TPs that work: 1, 2\)"):
            check_fp8_block_shapes(a3b, tp)
    spec = LaunchSpec(server="sglang", tp=8)
    with pytest.raises(ValueError, match="rollout.sglang.engine_tp: 8 with precision.rollout fp8"):
        SGLangEngine(sglang_section(), a3b, weight_dir=tmp_path, launch=spec, quantization="fp8")
    assert "q_proj" in fp8_block_shape_error(DENSE, 1)  # 4 heads x 8: smaller than a block

    save_hf_checkpoint(tmp_path / "bf16", canonical_hf_state(hf_model(FP8_DENSE, seed=3).state_dict()), FP8_DENSE)
    (tmp_path / "bf16" / "tokenizer.json").write_text("{}")
    out = export_block_fp8(tmp_path / "bf16", tmp_path / "fp8")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    assert (out / "tokenizer.json").is_file()
    assert export_block_fp8(out, tmp_path / "fp8-again").resolve() == out.resolve()  # block-FP8 already: linked


def test_one_sglang_command_line_for_the_trainer_and_slurm(tmp_path):
    """launcher.py and submit render SGLang's command line with the same function; --tp-size (not the --tp
    abbreviation) everywhere; --skip-tokenizer-init exactly when the checkpoint has no tokenizer files."""
    import shlex

    from megatron_pdm.cluster.submit import Submission, render
    from megatron_pdm.rollout.sglang.launcher import LaunchSpec, sglang_args
    from megatron_pdm.train.config import load_config

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    spec = LaunchSpec(server="sglang", tp=2)
    assert "--skip-tokenizer-init" in spec.command(0, str(tmp_path), 30000, 0)
    cmd = spec.command(0, str(tmp_path / "tok"), 30000, 0)
    assert "--skip-tokenizer-init" not in cmd and cmd[cmd.index("--tp-size") + 1] == "2"
    cfg = load_config(ROOT / "examples" / "presets" / "qwen3_8b.yaml")
    text = render(cfg, Submission(run_dir=Path("/scratch/x")))
    from megatron_pdm.cluster.plan import plan

    expected = sglang_args(str(cfg.train.init_path), dtype="bfloat16", memory_saver=True,
                           mem_fraction_static=plan(cfg).rollout.mem_fraction_static, skip_tokenizer_init=True)
    assert shlex.join(expected) in text
    engines = (ROOT / "slurm" / "engines.sh").read_text()
    assert engines.count("--tp-size") == 2 and '--tp "' not in engines
    moe = load_config(ROOT / "examples" / "presets" / "qwen3_30b_a3b.yaml",
                      ["rollout.routed_experts=true", "train.recompute=none"])
    assert "--enable-return-routed-experts" in render(moe, Submission(run_dir=Path("/scratch/x")))  # replay (R3)
    assert "--enable-return-routed-experts" not in text


@pytest.mark.e2e
def test_weight_update_sessions_refusals_and_slow_generations(hooked_workers, tmp_path, caplog, monkeypatch):
    """SGLang 0.5.23's weight-update session, as `serve` enforces it: tensor and distributed updates are refused
    outside one, `begin` inside one, `end` outside one; a disk load is taken inside one too (as 0.5.23 takes it).
    The client opens and closes one around every tensor and distributed update (a session a crashed update left open
    is closed first) and none around a disk update. A generation slower than its timeout on a healthy engine is sent
    again and finishes, the engine kept. A distributed update an engine refuses before it takes part in the
    broadcast fails the update at once, naming the engine (with NCCL, rank 0 would otherwise wait in the broadcast
    forever)."""
    from megatron_pdm.rollout.sglang.pool import Rejected, UpdateAborted

    urls, state = hooked_workers
    url = urls[0]
    engine = SGLangEngine(sglang_section(urls=urls, timeout_s=30, retries=1), DENSE, weight_dir=tmp_path / "weights",
                          backoff=0.1, dtype="bfloat16")
    engine.wait_ready(120)
    with pytest.raises(Rejected, match="must run between begin_weight_update.. and end_weight_update"):
        _post(url, "/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}, 30)
    with pytest.raises(Rejected, match="must run between begin_weight_update"):
        _post(url, "/update_weights_from_distributed", {"group_name": "g", "names": []}, 30)
    with pytest.raises(Rejected, match="no weight-update session is open"):
        _post(url, "/end_weight_update", {}, 30)
    _post(url, "/begin_weight_update", {}, 30)
    with pytest.raises(Rejected, match="already open"):
        _post(url, "/begin_weight_update", {}, 30)
    assert _post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "init")}, 30)["success"]
    # the session above is left open, as by a trainer that died mid-update: a disk update is taken inside it (as
    # 0.5.23 takes it) and leaves it open; the next tensor update's begin is refused, so it ends that session and
    # begins its own
    try:
        engine.weight_sync = "disk"
        with caplog.at_level("WARNING"):
            engine.update_weights(state, version=1)
        assert engine.pool.alive == urls and "refused a disk update" not in caplog.text
        for version, sync in enumerate(("tensor", "distributed", "tensor"), start=2):
            engine.weight_sync = sync
            engine.update_weights(state, version=version)
            assert engine.pool.alive == urls, sync
        for u in urls:  # no session left open anywhere: begin and end both succeed
            _post(u, "/begin_weight_update", {}, 30)
            _post(u, "/end_weight_update", {}, 30)

        # a healthy engine slower than the request timeout: timeout 1 s + 4 tokens at 100 tokens/s
        # retries: room for a re-sent request that a loaded machine slows too
        slow = SGLangEngine(sglang_section(urls=urls[:1], timeout_s=1, tokens_per_s=100.0, retries=3), DENSE,
                            weight_dir=tmp_path / "w2", backoff=0.1)
        slow.wait_ready(30)
        slow.weight_version = 4
        _post(url, "/megatron_pdm/faults", {"delay_generates": 1, "delay_s": 3.0}, 10)
        with caplog.at_level("WARNING"):
            samples = slow.generate([[5, 6]], SamplingParams(max_new_tokens=4, n=1, seed=3))
        assert len(samples) == 1 and samples[0].weight_version == 4 and slow.pool.alive == urls[:1]
        assert "no answer within 1 s" in caplog.text and "answers /health" in caplog.text

        # a disk load slower than the update timeout (1 s): never sent again, and not a failure: the client polls
        # /model_info's weight_version (for up to another update timeout) until the engine reports the new version.
        # Regression: it polled /get_weight_version, which SGLang 0.5.23 has not (404: a healthy engine dropped),
        # and serve has no more either
        _post(url, "/megatron_pdm/faults", {"delay_updates": 1, "delay_s": 1.4}, 10)
        caplog.clear()
        with caplog.at_level("WARNING"):
            slow.update_weights(state, version=5)
        assert _get_json(url, "/megatron_pdm/faults")["received"] == {"/update_weights_from_disk": 1}
        assert slow.pool.alive == urls[:1] and slow.weight_version == 5
        assert _get_json(url, "/model_info")["weight_version"] == "5"
        assert "polling /model_info" in caplog.text and "took the update to version 5" in caplog.text
        with pytest.raises(Rejected, match="HTTP 404"):
            _get_json(url, "/get_weight_version")

        engine.weight_sync = "distributed"
        monkeypatch.setattr(transports, "REFUSAL_GRACE_S", 1.0)  # the grace, shortened: what counts is that it ends

        class Queued:  # NCCL's semantics on gloo: wait() returns once the kernel is queued, is_completed() is true
            def __init__(self, work):
                self.work = work

            def wait(self, timeout=None):
                return True

            def is_completed(self):
                return self.work.is_completed()

        real_start = transports.weight_transfer.start_broadcast
        monkeypatch.setattr(transports.weight_transfer, "start_broadcast",
                            lambda pg, tensors: [Queued(w) for w in real_start(pg, tensors)])
        _post(urls[1], "/megatron_pdm/faults", {"refuse_updates": 1}, 10)
        start = time.monotonic()
        with pytest.raises(UpdateAborted, match=f"refused by {urls[1]} .*injected refusal.* before it took part"):
            engine.update_weights(state, version=5)
        assert time.monotonic() - start < 20  # the refusal's grace, not the 30 s update timeout
        assert engine.pool.alive == [] and engine.weight_version == 4  # refused and stuck engines: all out of service
        assert engine.transports["distributed"].group is None  # aborted, never destroyed (close has nothing to do)
    finally:
        engine.close()


def test_tensor_updates_pickle_per_engine_rank_and_keep_buckets_until_the_session_ends(monkeypatch):
    """Unit (no server): `TensorTransport` serializes each bucket once per engine TP rank and per target (SGLang
    0.5.23 deserializes only its rank's entry, and a CUDA IPC pickle is good for one reader), a fresh list per
    target, and what it returns keeps every bucket alive until the session is closed on every engine (SGLang answers
    before its copies ran), then lets them go."""
    import weakref

    from megatron_pdm.rollout.sglang import pool as pool_module
    from megatron_pdm.rollout.sglang import weight_transfer
    from megatron_pdm.rollout.sglang.pool import WorkerPool

    urls, tp = ["http://e0:1", "http://e1:1"], 2
    refs, bodies, calls, alive_at_end = [], {}, [], []

    def serialize(named):
        refs.extend(weakref.ref(t) for _, t in named)
        return f"pickle-{len(refs)}"

    def post(url, path, body, timeout):
        calls.append((url, path))
        if path == "/update_weights_from_tensor":
            bodies.setdefault(url, []).append(body["serialized_named_tensors"])
        if path == "/end_weight_update":
            alive_at_end.append(all(r() is not None for r in refs))
        return {"success": True}

    monkeypatch.setattr(weight_transfer, "serialize_named_tensors", serialize)
    # a plain copy for the shared-memory one (whose first use starts torch's shm manager process)
    monkeypatch.setattr(weight_transfer, "shared", lambda named: [(n, t.clone()) for n, t in named])
    monkeypatch.setattr(pool_module, "post", post)
    pool = WorkerPool(urls, launch=None, router=False, timeout=5, retries=0, backoff=0, max_restarts=0, inflight=1)
    transport = transports.TensorTransport(pool, engine_tp=tp, bucket_bytes=64 * 4)
    state = {f"w{i}": torch.full((64,), float(i)) for i in range(3)}  # 64 floats a bucket: 3 buckets
    pool.update(1, lambda targets: transport.send(state, 1, targets), session=True)
    assert len(refs) == 3 * len(urls) * tp  # a pickle per bucket, target and engine rank
    lists = [x for url in urls for x in bodies[url]]
    assert all(len(x) == tp for x in lists) and len(lists) == 3 * len(urls)
    assert len({id(x) for x in lists}) == len(lists) and len({p for x in lists for p in x}) == len(refs)
    for url in urls:  # the session around every bucket
        paths = [p for u, p in calls if u == url]
        assert paths == ["/pause_generation", "/begin_weight_update", *["/update_weights_from_tensor"] * 3,
                         "/end_weight_update", "/continue_generation"], paths
    assert alive_at_end == [True, True]  # every bucket alive until the last session closed, then let go
    assert not any(r() is not None for r in refs) and pool.alive == urls and pool.weight_version == 1


def test_an_engine_refusing_the_weights_group_fails_it_at_once(monkeypatch):
    """Unit (no server): an engine answering /init_weights_update_group with a failure never joins; the group's
    construction (here held as by a store waiting for that member) is abandoned at once, the WorkerError naming
    that engine, not after the group's timeout; a group still made afterwards is destroyed."""
    from types import SimpleNamespace

    from megatron_pdm.rollout.sglang.pool import Rejected, WorkerError

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    joined, destroyed, made = threading.Event(), [], object()

    def post(url, path, body, timeout):
        if url == urls[1]:
            raise Rejected(f"{url}{path}: HTTP 400: injected refusal", 400)
        joined.wait(10)
        return {"success": True}

    monkeypatch.setattr(transports, "post", post)
    monkeypatch.setattr(transports.weight_transfer, "custom_process_group", lambda *a, **k: joined.wait(10) and made)
    monkeypatch.setattr(transports.weight_transfer, "destroy_group", destroyed.append)
    pool = SimpleNamespace(timeout=60.0, update_timeout=60.0)
    transport = transports.DistributedTransport(pool, engine_tp=1, bucket_bytes=1 << 20, backend="gloo",
                                                master_address=None)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=f"refused by {urls[1]} .*injected refusal.*never joins") as e:
        transport._init_group(urls)
    assert e.value.urls == (urls[1],) and time.monotonic() - start < 5 and transport.group is None
    joined.set()
    _poll(lambda: destroyed == [made], "the abandoned group destroyed", 10)


def test_an_answer_cut_short_is_a_worker_failure():
    """Regression: a worker killed while it wrote an answer (headers sent, the body cut) raised http.client's
    IncompleteRead out of `generate` instead of a WorkerError, which takes the worker out of service and sends the
    request again (found when test_launched_engines_distributed_sync_and_restart killed its victim as answers
    flowed)."""
    import http.server

    from megatron_pdm.rollout.sglang.pool import WorkerError, request

    class CutShort(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b'{"text": ')  # 9 of the 100 bytes promised, then the connection closes
            self.close_connection = True

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), CutShort)
    server.timeout = 10  # handle_request gives up after 10 s without a request
    thread = threading.Thread(target=server.handle_request)
    thread.start()
    try:
        with pytest.raises(WorkerError, match="the answer was cut short"):
            request(f"http://127.0.0.1:{server.server_port}", "/generate", {"input_ids": [1]}, 10)
    finally:
        thread.join(20)
        server.server_close()


def test_stage_broadcasts_only_where_every_stage_reaches_the_engines(tmp_path):
    """Unit (no server): each stage broadcasts its own layers under distributed sync, except when the trainer spans
    several nodes and an engine's URL is loopback (launched engines bind 127.0.0.1), which other nodes cannot reach:
    then the later stages relay through rank 0."""
    def engine(url, sync="distributed"):
        return SGLangEngine(sglang_section(urls=[url], weight_sync=sync), DENSE, weight_dir=tmp_path)

    local, remote = engine("http://127.0.0.1:30000"), engine("http://10.1.2.3:30000")
    assert local.takes_stage_broadcasts(single_node=True) and not local.takes_stage_broadcasts(single_node=False)
    assert remote.takes_stage_broadcasts(single_node=True) and remote.takes_stage_broadcasts(single_node=False)
    assert not engine("http://10.1.2.3:30000", "disk").takes_stage_broadcasts()
    assert not engine("http://[::1]:30000").takes_stage_broadcasts(single_node=False)


def test_a_disk_update_refused_inside_a_session_ends_it_and_loads_again():
    """SGLang 0.5.23 and serve take a disk update inside a weight-update session; a server that refuses one,
    saying a session is open (one a crashed update left), gets that session ended and the load sent again, once."""
    import http.server
    import json

    routes = []

    class Strict(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            routes.append(self.path)
            refuse = self.path == "/update_weights_from_disk" and "/end_weight_update" not in routes
            data = json.dumps({"success": not refuse, "message": "a weight-update session is open" if refuse
                               else "Success"}).encode()
            self.send_response(400 if refuse else 200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    from megatron_pdm.rollout.sglang.pool import WorkerPool

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Strict)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        pool = WorkerPool([url], launch=None, router=False, timeout=10, retries=0, backoff=0, max_restarts=0,
                          inflight=1)
        assert pool.load_from_disk(url, {"model_path": "/x", "weight_version": "1"})["success"]
        assert routes == ["/update_weights_from_disk", "/end_weight_update", "/update_weights_from_disk"]
    finally:
        server.shutdown()
        server.server_close()


# a trainer-side process: one tensor update's shared-memory copy, its pickle handed to a detached process that maps
# it (an engine) and holds it until the test lets go; then the trainer-side process exits
_SHARES_AND_EXITS = """
import subprocess, sys
import torch
from megatron_pdm.rollout.sglang import weight_transfer
named = weight_transfer.shared([("w", torch.arange(4.0))])
holder = ("import pathlib, sys, time; from megatron_pdm.rollout.sglang import weight_transfer; "
          "held = weight_transfer.deserialize_named_tensors(sys.argv[1]); print(float(held[0][1].sum()), flush=True); "
          "end = time.monotonic() + 300\\nwhile not pathlib.Path(sys.argv[2]).exists() and time.monotonic() < end: "
          "time.sleep(0.1)")
proc = subprocess.Popen([sys.executable, "-c", holder, weight_transfer.serialize_named_tensors(named), sys.argv[1]],
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                        start_new_session=True)
print("engine holds", proc.stdout.readline().decode().strip(), flush=True)
print("exits", file=sys.stderr, flush=True)
"""


def _eof(fd: int, seconds: float) -> bool:
    """Whether reading `fd` reaches its end (every writer closed it) within `seconds`."""
    import select

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if ready and not __import__("os").read(fd, 65536):
            return True
    return False


@pytest.mark.e2e
def test_the_shared_memory_daemon_holds_none_of_the_trainers_descriptors(tmp_path):
    """Regression: the tensor transport's first CPU share starts torch's torch_shm_manager daemon, which inherited
    the process's stdin, stderr and every inheritable descriptor, and lives while an engine maps its files:
    `megatron-pdm train 2>&1 | tee log` waited for it after the run, and so did the trainer's launcher, whose
    rank's spawn sentinel (an inheritable pipe, here `sentinel`) it held: `train` with tensor sync to an attached
    SGLang never returned. Both pipes now reach their end when the process exits, while the engine still holds
    the weights."""
    import os
    import subprocess
    import sys

    release = tmp_path / "release"
    sentinel_r, sentinel_w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", _SHARES_AND_EXITS, str(release)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            pass_fds=(sentinel_w,))
    os.close(sentinel_w)
    try:
        output = proc.communicate(timeout=120)[0]  # up to the end of the pipe; bounded: the daemon may hold it
        closed = True
    except subprocess.TimeoutExpired:
        output, closed = b"", False
    try:
        sentinel_closed = _eof(sentinel_r, 30)  # the process exited by now; only a child of it holds the pipe
    finally:
        release.touch()  # the holder lets go (and the daemon exits after it)
        proc.kill()
        proc.wait()
        os.close(sentinel_r)
    assert closed, "the output pipe stayed open after the process exited: torch_shm_manager holds it"
    assert b"engine holds 6.0" in output and b"exits" in output
    assert sentinel_closed, "an inheritable descriptor stayed open after the process exited: torch_shm_manager holds it"


def test_the_probe_reads_the_launch_checkpoint_when_the_served_export_is_gone(tmp_path):
    # review of issue 51's probe: it read only /model_info's path, the export served now; an engine still serving an
    # export that a later one replaced (deleted: an update that failed, then a new trainer attaching) made the
    # probe fail ("cannot tell whether the engine is quantized") though /server_info's launch checkpoint answers
    import shutil

    server, url, stop = _in_process_server(tmp_path, DENSE)
    try:
        shutil.copytree(tmp_path / "init", tmp_path / "v000001")
        assert _post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "v000001")}, 30)["success"]
        assert transports.probe_engines([url], 30)[url].quantization is None
        shutil.rmtree(tmp_path / "v000001")
        assert transports.probe_engines([url], 30)[url] == transports.EngineProbe(None, True, False)  # was: ValueError
    finally:
        stop()
