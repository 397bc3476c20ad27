"""Real SGLang on a GPU (skipped without CUDA and the sglang package, pinned in the `gpu` extra): `SGLangEngine`
launching `python -m sglang.launch_server` for a small Qwen3 built here (no hub access), checked against the
Megatron trainer's recomputation of the same log-probs. One H200 is enough.

    pytest -q -s tests/gpu/test_sglang_engine.py     # about 5 minutes; writes sglang_gpu.json

1. top-K log-probs of bf16 and fp16 engines vs megatron-core's fp32 log_softmax(logits / T) at the same ids:
   the training-inference mismatch, reported as the top-K KL(mu || pi) estimate and max |log mu - log pi|;
2. weight updates: by NCCL broadcast (/update_weights_from_distributed) with the trainer's side on a second GPU
   when there is one (NCCL refuses a group with two ranks on one device), else by CUDA IPC
   (/update_weights_from_tensor, the engine on the same GPU); then from disk. The engines then sample from the
   new weights (their log-probs match the recomputation under the new weights, not the old);
3. an FP8 engine started from the trainer's block-FP8 export takes block-FP8 updates (the path `submit` and
   the trainer use for precision.rollout fp8);
4. two engines behind sglang-router: every prompt answered once, at the pushed weight version;
5. it records a real /generate response (request and answer) as tests/data/sglang/generate_recorded.json, which
   the CPU schema tests then use in place of the hand-written one (copy it into the repository);
6. SGLang's weight-update session contract as the bf16 engine answers it (status and body of a tensor update
   outside a session, an `end` with none open, a `begin` twice, a disk update inside a session), then the
   client's handling of a session left open, before a disk and before a tensor update (`_session_contract`).

The engine interpreter's sglang, torch, transformers and flashinfer versions go into the results (engine/*),
with the numbers above, in sglang_gpu.json and run_all.sh's summary.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# the engines' own environment (`make engine-env`: sglang's pins differ from the trainer's), else this one
ENGINE_PYTHON = os.environ.get("MEGATRON_PDM_ENGINE_PYTHON", sys.executable)
# the engine interpreter's versions, as one JSON line: None for a package it cannot import
_VERSIONS = """
import importlib, json
found = {}
for name in ("sglang", "torch", "transformers", "flashinfer"):
    try:
        found[name] = str(getattr(importlib.import_module(name), "__version__", "unknown"))
    except Exception:
        found[name] = None
print(json.dumps(found))
"""


def _engine_versions() -> dict:
    try:
        out = subprocess.run([ENGINE_PYTHON, "-c", _VERSIONS], capture_output=True, text=True, timeout=300)
        return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else {}
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}


ENGINE_VERSIONS = _engine_versions()
if not ENGINE_VERSIONS.get("sglang"):
    pytest.skip(f"{ENGINE_PYTHON} cannot import sglang", allow_module_level=True)
SGLANG_VERSION = ENGINE_VERSIONS["sglang"]

from megatron_pdm.models import ModelConfig, canonical_hf_state  # noqa: E402
from megatron_pdm.precision import fp8_block_shape_error  # noqa: E402
from megatron_pdm.rollout import SamplingParams  # noqa: E402
from megatron_pdm.rollout.sglang.client import SGLangEngine, _post  # noqa: E402
from megatron_pdm.rollout.sglang.launcher import LaunchSpec, router_available  # noqa: E402
from tests.helpers import hf_model, rank_engine_check, sglang_section  # noqa: E402

# block-FP8 loadable at TP 1: q, k / v and gate / up shards are multiples of 128
CFG = ModelConfig(vocab_size=4096, hidden_size=256, num_layers=4, num_attention_heads=4, num_query_groups=2,
                  head_dim=64, ffn_hidden_size=512, max_position_embeddings=512)
T, K = 0.8, 8
RESULTS = {f"engine/{name}": version or "not importable" for name, version in ENGINE_VERSIONS.items()}
DATA = Path(__file__).resolve().parents[1] / "data" / "sglang"


def _engine(tmp_path, dtype, num_engines=1, quantization=None, **rollout):
    spec = LaunchSpec(server="sglang", num_engines=num_engines, dtype=dtype, log_dir=tmp_path / "logs",
                      server_args=("--mem-fraction-static", "0.2", "--disable-cuda-graph"), startup_timeout_s=300,
                      python=ENGINE_PYTHON)
    return SGLangEngine(sglang_section(timeout_s=120, **rollout), CFG, weight_dir=tmp_path / "weights", launch=spec,
                        dtype=dtype, quantization=quantization)


def _state(seed):
    return canonical_hf_state(hf_model(CFG, seed=seed).state_dict())


def _mismatch(dist_pools, state, samples):
    """Top-K KL(mu || pi) estimate sum_k mu_k (log mu_k - log pi_k) per token, and max |log mu(a) - log pi(a)|."""
    recomputed = dist_pools(1).run(rank_engine_check, shared=(CFG, 1, state, T, samples))[0]
    kl, diff = [], []
    for s, (lp, top) in zip(samples, recomputed, strict=True):
        mu = s.topk_logprobs.double()
        kl.append((mu.exp() * (mu - top.double())).sum(-1))
        diff.append((s.token_logprobs.double() - lp.double()).abs())
    return float(torch.cat(kl).mean()), float(torch.cat(diff).max())


def _record_response(engine, params):
    """A real /generate request of the client and SGLang's answer, unchanged, for the CPU schema tests."""
    request = engine._request([11, 12, 13, 14], params, SGLangEngine.sample_seeds(params, 0))
    response = _post(engine.pool.alive[0], "/generate", request, 120)
    record = {"source": f"recorded by tests/gpu/test_sglang_engine.py from SGLang {SGLANG_VERSION} on "
                        f"{torch.cuda.get_device_name()}", "sglang_version": SGLANG_VERSION,
              "vocab_size": CFG.vocab_size, "request": request, "response": response}
    text = json.dumps(record, indent=1) + "\n"
    (DATA / "generate_recorded.json").write_text(text)
    if os.environ.get("MEGATRON_PDM_GPU_OUT"):
        (Path(os.environ["MEGATRON_PDM_GPU_OUT"]) / "generate_recorded.json").write_text(text)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_topk_logprobs_and_weight_updates(dist_pools, tmp_path, dtype):
    prompts = [[11 + i, 12 + i, 13 + i, 14 + i] for i in range(32)]
    params = SamplingParams(max_new_tokens=32, n=2, temperature=T, top_k_logprobs=K, seed=0)
    two_gpus = torch.cuda.device_count() >= 2
    engine = _engine(tmp_path, dtype, weight_sync="distributed" if two_gpus else "tensor")
    try:
        old = _state(1)
        engine.update_weights(old, version=0)  # starts the server (GPU 0) from the disk export
        if dtype == "bfloat16":
            _record_response(engine, params)
        samples = engine.generate(prompts, params)
        for s in samples:
            assert s.topk_ids.shape[1] == K and bool((s.topk_logprobs[:, :-1] >= s.topk_logprobs[:, 1:]).all())
        group = [tuple(s.response_ids.tolist()) for s in samples[:2]]
        RESULTS[f"{dtype}/distinct_samples_of_a_group"] = len(set(group))
        kl, worst = _mismatch(dist_pools, old, samples)
        RESULTS[f"{dtype}/kl_topk"], RESULTS[f"{dtype}/max_abs_log_ratio"] = kl, worst
        assert kl < (2e-3 if dtype == "float16" else 1e-2), kl

        new = _state(2)
        if two_gpus:  # NCCL broadcast from this process on GPU 1 to the engine on GPU 0
            torch.cuda.set_device(1)
        engine.update_weights({k: v.cuda() for k, v in new.items()}, version=1)
        RESULTS[f"{dtype}/update_1"] = engine.weight_sync
        samples = engine.generate(prompts, params)
        assert all(s.weight_version == 1 for s in samples)
        assert _mismatch(dist_pools, new, samples)[0] < 1e-2
        assert _mismatch(dist_pools, old, samples)[0] > 10 * kl  # the engine no longer samples the old weights

        engine.weight_sync = "disk"
        engine.update_weights(old, version=2)
        samples = engine.generate(prompts, params)
        assert all(s.weight_version == 2 for s in samples)
        assert _mismatch(dist_pools, old, samples)[0] < 1e-2
        if dtype == "bfloat16":
            torch.cuda.set_device(0)
            _session_contract(engine, old, prompts[:4], params)
    finally:
        engine.close()
        torch.cuda.set_device(0)


def _answer(url, path, body) -> dict:
    """{"status", "body"} of one POST as the engine answers it (sent once; a 4xx or 5xx included)."""
    from megatron_pdm.rollout.sglang.pool import Rejected, WorkerError, request

    try:
        return {"status": 200, "body": request(url, path, body, 120)}
    except (Rejected, WorkerError) as e:
        m = re.search(r": HTTP (\d+): (.*)$", str(e), flags=re.S)
        return {"status": int(m[1]), "body": m[2]} if m else {"status": None, "body": str(e)}


def _refused(answer: dict) -> bool:
    """An `_answer` that is a refusal: not 200, or 200 with success false."""
    body = answer["body"]
    return answer["status"] != 200 or (isinstance(body, dict) and body.get("success") is False)


def _session_contract(engine, state, prompts, params):
    """SGLang's weight-update session contract as this engine answers it, recorded (session/*: status and body)
    before anything is asserted: a tensor update outside a session, an `end` with none open, a `begin` twice, a disk
    update inside a session. Then what the client relies on: a tensor update outside a session is refused (hence
    the sessions), a second `begin` is refused (how a session left open is found and ended before a tensor
    update), a disk update inside a session is taken or refused saying a session is open (how one is ended
    before a disk update); and through the client, a session left open before a disk update and before a tensor
    update: the engine stays in service, no session is left open, and it samples at the last version."""
    from megatron_pdm.rollout.sglang import weight_transfer
    from megatron_pdm.rollout.sglang.pool import says_session_open

    url = engine.pool.alive[0]
    name, value = next((n, t) for n, t in state.items() if n.endswith("norm.weight"))
    named = [(name, value.to(torch.bfloat16).to("cuda:0"))]  # its current value: harmless if it is taken
    tensor_body = {"serialized_named_tensors": [weight_transfer.serialize_named_tensors(named)],
                   "load_format": None, "flush_cache": False}
    disk_body = {"model_path": str(engine.pool.export[0]), "weight_version": str(engine.weight_version),
                 "flush_cache": True}
    cases = {}
    _post(url, "/pause_generation", {}, 120)
    try:
        cases["tensor_update_outside_a_session"] = _answer(url, "/update_weights_from_tensor", tensor_body)
        cases["end_with_none_open"] = _answer(url, "/end_weight_update", {})
        cases["begin"] = _answer(url, "/begin_weight_update", {})
        cases["begin_again"] = _answer(url, "/begin_weight_update", {})
        cases["disk_update_inside_a_session"] = _answer(url, "/update_weights_from_disk", disk_body)
        cases["end"] = _answer(url, "/end_weight_update", {})
    finally:
        _post(url, "/continue_generation", {}, 120)
        for case, answer in cases.items():
            body = answer["body"] if isinstance(answer["body"], str) else json.dumps(answer["body"])
            RESULTS[f"session/{case}"] = f"{answer['status']} {body[:300]}"
        del named
    assert _refused(cases["tensor_update_outside_a_session"]), cases
    assert not _refused(cases["begin"]) and _refused(cases["begin_again"]), cases
    disk = cases["disk_update_inside_a_session"]
    assert not _refused(disk) or says_session_open(str(disk["body"])), disk

    _answer(url, "/begin_weight_update", {})  # left open, as by a trainer that died mid-update
    engine.weight_sync = "disk"
    engine.update_weights(state, version=3)
    assert engine.pool.alive == [url]
    _answer(url, "/begin_weight_update", {})  # (refused if the disk update left the first one open)
    engine.weight_sync = "tensor"
    engine.update_weights({k: v.to("cuda:0") for k, v in state.items()}, version=4)
    assert engine.pool.alive == [url]
    assert [_answer(url, p, {})["status"] for p in ("/begin_weight_update", "/end_weight_update")] == [200, 200]
    assert all(s.weight_version == 4 for s in engine.generate(prompts, params))
    RESULTS["session/client_after_a_session_left_open"] = "disk and tensor updates taken"


def test_fp8_engine_takes_block_fp8_updates(dist_pools, tmp_path):
    assert fp8_block_shape_error(CFG, 1) is None
    prompts = [[11 + i, 12 + i, 13 + i] for i in range(16)]
    params = SamplingParams(max_new_tokens=16, n=2, temperature=T, top_k_logprobs=K, seed=1)
    engine = _engine(tmp_path, "bfloat16", quantization="fp8", weight_sync="tensor")
    try:
        engine.update_weights(_state(5), version=0)  # starts from the block-FP8 export, no --quantization
        new = _state(6)
        engine.update_weights({k: v.cuda() for k, v in new.items()}, version=1)  # block-FP8 pairs by CUDA IPC
        samples = engine.generate(prompts, params)
        assert all(s.weight_version == 1 for s in samples)
        kl = _mismatch(dist_pools, new, samples)[0]
        RESULTS["fp8/kl_topk_vs_bf16_weights"] = kl
        assert kl < 0.1, kl  # FP8 weights: a larger mismatch, but the new weights
        engine.weight_sync = "disk"
        engine.update_weights(_state(5), version=2)
        assert all(s.weight_version == 2 for s in engine.generate(prompts[:4], params))
    finally:
        engine.close()


@pytest.mark.skipif(not router_available(), reason="sglang-router not installed")
def test_two_engines_behind_the_router(tmp_path):
    engine = _engine(tmp_path, "bfloat16", num_engines=2, router=True)
    try:
        engine.update_weights(_state(3), version=0)
        assert engine.pool.router is not None and len(engine.pool.router.workers()) == 2
        out = engine.generate([[20 + i, 21] for i in range(64)], SamplingParams(max_new_tokens=16, n=2, seed=1))
        assert [s.prompt_index for s in out] == [i for i in range(64) for _ in range(2)]
    finally:
        engine.close()


def teardown_module():
    path = Path(os.environ.get("MEGATRON_PDM_GPU_OUT", ".")) / "sglang_gpu.json"
    path.write_text(json.dumps(RESULTS, indent=2))
    print(json.dumps(RESULTS, indent=2))
