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
    with pytest.raises(ValueError, match="HTTP 400.*top_p = 1"):
        from megatron_pdm.rollout.sglang import _post

        _post(engine.alive[0], "/generate", {"input_ids": [1, 2], "sampling_params": {"top_p": 0.9}}, 10)


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
    d["model"] = DENSE.__dict__
    d["rollout"].update(engine="sglang", urls=list(engine.urls))
    from megatron_pdm.train.config import config_from_dict

    rows = dist_pools(1).run(rank_train, shared=(config_from_dict(d), str(tmp_path / "run")))[0]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "run" / "weights").iterdir()) == ["v000000", "v000001", "v000002"]
