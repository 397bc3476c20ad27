"""One contract for every `RolloutEngine` that `build_engine` makes: the embedded engine, and the SGLang client over
real `megatron-pdm serve` servers it launches (one per weight transport). What the trainer relies on: start, no
rollout before weights, samples in prompt order carrying the pushed version, reproducible under a seed, log-probs
of the weights pushed last, a full state dict and a stream of buckets loading the same weights, memory release
and resume, close."""

import os
from dataclasses import replace

import pytest
import torch

from megatron_pdm.models import canonical_hf_state
from megatron_pdm.precision import PrecisionConfig
from megatron_pdm.rollout import RolloutEngine, SamplingParams, build_engine
from megatron_pdm.rollout.multi_turn import multi_turn
from megatron_pdm.train.config import RolloutConfig
from tests.helpers import DENSE, hf_model, rank_engine_check

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENGINES = {
    "embedded": dict(engine="embedded"),
    "sglang-disk": dict(engine="sglang", sglang=dict(server="megatron-pdm", num_engines=1, weight_sync="disk")),
    "sglang-distributed": dict(engine="sglang", sglang=dict(server="megatron-pdm", num_engines=1,
                                                            weight_sync="distributed")),
    "sglang-tensor": dict(engine="sglang", sglang=dict(server="megatron-pdm", num_engines=1, weight_sync="tensor",
                                                       release_memory=True)),
}
PARAMS = SamplingParams(max_new_tokens=5, n=2, temperature=0.8, top_k_logprobs=4, stop_token_ids=(3,), seed=13)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


@pytest.fixture(params=list(ENGINES))
def engine(request, tmp_path):
    section = ENGINES[request.param]
    rollout = RolloutConfig(**{**section, "sglang": {**section.get("sglang", {}), "timeout_s": 60.0}})
    e = build_engine(rollout, DENSE, PrecisionConfig(), run_dir=tmp_path)
    e.start()
    e.start()  # idempotent
    yield e
    e.close()


def _state(seed):
    return canonical_hf_state(hf_model(DENSE, seed=seed).state_dict())


def _stream(state, per_bucket=5):
    """`state` as buckets of `per_bucket` tensors, each bucket emptied when the next is asked for (as the trainer's
    export does: a consumer must not keep them)."""
    keys = list(state)
    for i in range(0, len(keys), per_bucket):
        bucket = {k: state[k].clone() for k in keys[i : i + per_bucket]}
        yield bucket
        bucket.clear()


def _same(a, b):
    return all(torch.equal(x.response_ids, y.response_ids) and torch.equal(x.token_logprobs, y.token_logprobs)
               and torch.equal(x.topk_ids, y.topk_ids) for x, y in zip(a, b, strict=True))


def test_engine_contract(dist_pools, engine):
    assert isinstance(engine, RolloutEngine)
    with pytest.raises(RuntimeError, match="no weights"):
        engine.generate(PROMPTS, PARAMS)

    first = _state(21)
    engine.update_weights(first, version=1)
    samples = engine.generate(PROMPTS, PARAMS)
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
    assert all(s.weight_version == 1 and s.prompt_ids == PROMPTS[s.prompt_index] for s in samples)
    for s in samples:
        L = len(s.response_ids)
        assert 1 <= L <= PARAMS.max_new_tokens and s.topk_ids.shape == s.topk_logprobs.shape == (L, 4)
        assert bool((s.topk_logprobs[:, :-1] >= s.topk_logprobs[:, 1:]).all())  # sorted, most likely first
        assert s.finish_reason == ("stop" if int(s.response_ids[-1]) == 3 else "length")
    assert _same(samples, engine.generate(PROMPTS, PARAMS))  # the seed makes a rollout reproducible

    # a stream of buckets loads the same weights as the full dict: same samples under the same seed
    second = _state(22)
    engine.update_weights(second, version=2)
    full = engine.generate(PROMPTS, PARAMS)
    engine.update_weights(first, version=3)
    engine.update_weights(_stream(second), version=4)
    streamed = engine.generate(PROMPTS, PARAMS)
    assert all(s.weight_version == 4 for s in streamed) and _same(full, streamed)
    # log mu = log_softmax(logits / T) of the weights pushed last (the trainer's recomputation; fp32 engines, the
    # tolerance covers the two implementations' summation orders)
    recomputed = dist_pools(1).run(rank_engine_check, shared=(DENSE, 1, second, PARAMS.temperature, streamed))[0]
    for s, (lp, top) in zip(streamed, recomputed, strict=True):
        torch.testing.assert_close(s.token_logprobs, lp, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s.topk_logprobs, top, atol=1e-4, rtol=1e-4)

    # split invariance: a generation cut at 2 tokens and extended after a weight update (the same weights, a new
    # version) draws the uncut one's tokens, each tagged with the version that generated it; log-probs within
    # float error (the extension prefills what the uncut one decoded token by token)
    cut = engine.generate(PROMPTS, replace(PARAMS, max_new_tokens=2))
    engine.update_weights(second, version=5)
    extended = engine.extend(cut, PARAMS)
    for s, c, x in zip(streamed, cut, extended, strict=True):
        x.check()
        assert torch.equal(x.response_ids, s.response_ids) and x.finish_reason == s.finish_reason
        assert x.versions().tolist() == [4] * len(c.response_ids) + [5] * (len(s.response_ids) - len(c.response_ids))
        assert x.spans()[0] == (4, 0, len(c.response_ids)) and x.seed == c.seed is not None
        torch.testing.assert_close(x.token_logprobs, s.token_logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.topk_logprobs, s.topk_logprobs, atol=1e-5, rtol=1e-5)

    # multi-turn (rollout/multi_turn.py): every token stops a turn; a three-token reply follows each turn of prompts
    # 0 and 2 (prompt 1's first turn is final). A turn after a reply is what a generation from the whole context
    # (prompt, turns and replies) draws with the sample's seed at its positions: the engine reads the reply
    one_token = replace(PARAMS, stop_token_ids=tuple(range(DENSE.vocab_size)), max_new_tokens=12)
    reply, asked = [7, 8, 9], []

    def tool(s):
        asked.append((s.prompt_index, s.seed, len(s.response_ids)))
        return None if s.prompt_index == 1 else reply

    turns = multi_turn(engine, PROMPTS, one_token, tool, max_turns=3)
    assert len(asked) == len(set(asked)) == 2 + 2 * 2 * 2  # once per stopped turn: a final one is not asked again
    for s in turns:
        s.check()
        if s.prompt_index == 1:
            assert len(s.response_ids) == 1 and s.trainable is None
            continue
        assert s.flags().tolist() == [True, False, False, False] * 2 + [True] and s.finish_reason == "stop"
        assert s.response_ids[1:4].tolist() == reply == s.response_ids[5:8].tolist() and s.last_turn().numel() == 1
        for t in (4, 8):
            alone = engine.generate([s.prompt_ids + s.response_ids[:t].tolist()],
                                    replace(one_token, n=1, seed=s.seed))[0]
            assert int(alone.response_ids[0]) == int(s.response_ids[t])
            torch.testing.assert_close(alone.token_logprobs[0], s.token_logprobs[t], atol=1e-5, rtol=1e-5)
    # a reply that leaves no token for the policy ends the sample as it is, cut
    short = multi_turn(engine, PROMPTS[:1], replace(one_token, max_new_tokens=4), lambda s: reply, max_turns=3)
    assert all(len(s.response_ids) == 1 and s.finish_reason == "length" for s in short)

    # release / resume: no rollout from released memory; the next update takes it back
    engine.release_memory()
    with pytest.raises(ValueError, match="memory released"):
        engine.generate(PROMPTS, PARAMS)
    engine.update_weights(_stream(second), version=6)
    assert _same(full, engine.generate(PROMPTS, PARAMS))
    engine.release_memory()
    engine.resume_memory()
    engine.resume_memory()  # a no-op unless released
    engine.update_weights(second, version=7)
    assert engine.weight_version == 7 and engine.health()


def test_engines_stop_at_the_checkpoints_eos_ids_as_sglang(tmp_path):
    """SGLang stops every request at its checkpoint's EOS ids (config.json's and generation_config.json's
    eos_token_id, the tokenizer's EOS) besides the request's stop_token_ids, unless it says ignore_eos. The embedded
    engine the trainer builds (its tokenizer's ids) and `serve` (its checkpoint's) stop there too: a response never
    runs past one (regression: both stopped at stop_token_ids only); with ignore_eos, at no token (SGLang drops
    stop_token_ids too). Seeded: the same samples in every run."""
    from megatron_pdm.models import save_hf_checkpoint
    from megatron_pdm.rollout.sglang.pool import post
    from megatron_pdm.train.data import ARITHMETIC_TOKENIZER
    from tests.helpers import _in_process_server

    eos = (2, 0)  # the arithmetic tokenizer's EOS and its generation_config.json's eos_token_id [2, 0]
    params = SamplingParams(max_new_tokens=24, n=16, temperature=1.0, top_k_logprobs=2, stop_token_ids=(3,), seed=7)
    embedded = build_engine(RolloutConfig(), DENSE, PrecisionConfig(), run_dir=tmp_path,
                            tokenizer_dir=ARITHMETIC_TOKENIZER)
    embedded.update_weights(_state(21), version=1)
    samples = embedded.generate([[5, 6, 7], [8, 9]], params)
    ends = [int(s.response_ids[-1]) for s in samples if s.finish_reason == "stop"]
    assert set(ends) & set(eos) and not any(set(s.response_ids[:-1].tolist()) & {3, *eos} for s in samples)

    save_hf_checkpoint(tmp_path / "init", _state(21), DENSE, tokenizer_dir=ARITHMETIC_TOKENIZER)
    _, url, stop = _in_process_server(tmp_path, DENSE, path=tmp_path / "init")
    try:
        for ignore, stops in ((None, {3, *eos}), (True, set())):
            rows = [{"max_new_tokens": 24, "stop_token_ids": [3], "sampling_seed": 100 + i,
                     **({} if ignore is None else {"ignore_eos": ignore})} for i in range(32)]
            out = post(url, "/generate", {"input_ids": [[5, 6, 7]] * 32, "sampling_params": rows}, 60)
            ids = [o["output_ids"] for o in out]
            ends = {r[-1] for r, o in zip(ids, out, strict=True) if o["meta_info"]["finish_reason"]["type"] == "stop"}
            assert ends <= stops and not any(set(r[:-1]) & stops for r in ids)
            assert (set(ends) & set(eos)) if ignore is None else any(set(r[:-1]) & {3, *eos} for r in ids)
    finally:
        stop()
    from megatron_pdm.rollout.sglang.wire import checkpoint_eos_ids

    assert set(checkpoint_eos_ids(tmp_path / "init", (2,))) == set(eos)
