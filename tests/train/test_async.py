"""Off-policy rollouts, the token as the unit: samples cut and continued at random points keep every per-token row
in step (slime #1440 was this bookkeeping), SGLang's per-token version spans and partial aborts parse as the token
versions they describe, and the lagged schedule's ages, resume and thread are what the schedule says."""

from dataclasses import replace
from itertools import pairwise

import pytest
import torch

from megatron_pdm._rundir import STOP_FILE
from megatron_pdm.models import canonical_hf_state
from megatron_pdm.rollout import SamplingParams
from megatron_pdm.rollout.embedded import EmbeddedEngine
from megatron_pdm.rollout.sglang.wire import AbortedRequest, parse_generate_output
from tests.helpers import DENSE, MOE, hf_model, sglang_section

PARAMS = SamplingParams(max_new_tokens=9, n=2, temperature=0.9, top_k_logprobs=4, seed=5)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_cut_and_continued_samples_keep_their_rows_in_step(cfg):
    """Random cut points (seeded): a generation cut into segments, each under a new version of the same weights,
    ends with the uncut generation's tokens, every per-token field (routed experts too) one row per token, and the
    versions of its segments."""
    engine = EmbeddedEngine(cfg)
    state = canonical_hf_state(hf_model(cfg, seed=3).state_dict())
    engine.update_weights(state, version=0)
    params = replace(PARAMS, return_routed_experts=cfg.is_moe)
    whole = engine.generate(PROMPTS, params)
    g = torch.Generator().manual_seed(11)
    for trial in range(3):
        cuts = sorted(torch.randperm(PARAMS.max_new_tokens - 1, generator=g)[: trial + 1].add(1).tolist())
        engine.update_weights(state, version=0)
        samples = engine.generate(PROMPTS, replace(params, max_new_tokens=cuts[0]))
        for v, c in enumerate(cuts[1:] + [PARAMS.max_new_tokens], start=1):
            engine.update_weights(state, version=v)
            samples = engine.extend(samples, replace(params, max_new_tokens=c))
        for s, w in zip(samples, whole, strict=True):
            s.check()
            assert torch.equal(s.response_ids, w.response_ids) and s.finish_reason == w.finish_reason
            bounds = [0] + [c for c in cuts if c < len(w.response_ids)] + [len(w.response_ids)]
            assert s.spans() == [(v, a, b) for v, (a, b) in enumerate(pairwise(bounds))]
            if cfg.is_moe:  # the prefix keeps the routing it was sampled under (here: the same weights' routing)
                assert torch.equal(s.routed_experts, w.routed_experts)


def _output(tokens, *, spans=None, finish="length", version="3"):
    meta = {"output_token_logprobs": [[-0.5, t, None] for t in tokens],
            "output_top_logprobs": [[[-0.5, t, None], [-1.0, 9, None]] for t in tokens],
            "weight_version": version, "finish_reason": {"type": finish}}
    if spans is not None:
        meta["weight_versions"] = spans
    return {"meta_info": meta}


def test_weight_version_spans_and_partial_aborts_parse_per_token():
    kw = dict(prompt_index=0, prompt_ids=[1], k=2, vocab_size=10, weight_version=3)
    two = [{"version": "2", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 3}]
    s = parse_generate_output(_output([4, 5, 6], spans=two), **kw, spans=True)
    assert s.versions().tolist() == [2, 2, 3] and s.oldest_version == 2 and s.weight_version == 3
    with pytest.raises(AbortedRequest, match="across weight versions"):  # sync mode: still sent again
        parse_generate_output(_output([4, 5, 6], spans=two), **kw)
    one = [{"version": "3", "start": 0, "end": 3}]
    assert parse_generate_output(_output([4, 5, 6], spans=one), **kw).token_versions is None
    for bad, msg in (([{"version": "4", "start": 0, "end": 3}], "versions up to 3"),
                     ([{"version": "2", "start": 0, "end": 2}], "cover 2 of 3"),
                     ([{"version": "2", "start": 1, "end": 3}], "after token 0"),
                     ([{"v": 2}], "expected {version, start, end}")):
        with pytest.raises(ValueError, match=f"weight_versions: .*{msg}"):
            parse_generate_output(_output([4, 5, 6], spans=bad), **kw, spans=True)
    with pytest.raises(ValueError, match="weight_version: 4, but the trainer pushed 3"):
        parse_generate_output(_output([4], version="4"), **kw, spans=True)
    # an abort: sent again, or with partial rollouts kept as a partial sample to extend
    with pytest.raises(AbortedRequest):
        parse_generate_output(_output([4, 5], finish="abort"), **kw)
    partial = parse_generate_output(_output([4, 5], spans=[{"version": "2", "start": 0, "end": 2}], finish="abort",
                                            version="2"), **kw, spans=True, partial=True)
    assert partial.finish_reason == "abort" and partial.versions().tolist() == [2, 2]


def test_old_tokens_leave_the_loss_and_ages_are_per_token():
    """max_token_age drops the tokens older than the bound (they stay in the context), and not-trainable tokens
    never train; the batch carries every token's age."""
    from megatron_pdm.train.batch import rollout_batch

    engine = EmbeddedEngine(DENSE)
    state = canonical_hf_state(hf_model(DENSE, seed=3).state_dict())
    engine.update_weights(state, version=4)
    samples = engine.generate(PROMPTS[:2], replace(PARAMS, max_new_tokens=2, n=1))
    engine.update_weights(state, version=6)
    samples = engine.extend(samples, replace(PARAMS, max_new_tokens=5))
    samples[1].trainable = torch.tensor([True, True, False, True, True])  # a tool's token, say
    adv = torch.ones(2)
    b = rollout_batch(samples, adv, pad_id=0, multiple=1, vocab_size=DENSE.vocab_size, version=7, max_age=1)
    assert b.token_age.tolist() == [3, 3, 1, 1, 1] * 2
    assert b.loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 1, 1]
    assert torch.equal(b.input_ids[0, :8], torch.tensor(PROMPTS[0] + samples[0].response_ids.tolist()))
    assert rollout_batch(samples, adv, pad_id=0, multiple=1, vocab_size=DENSE.vocab_size).token_age is None


def _rows(rows):
    """The rows without timings."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def test_lagged_schedule_ages_threads_and_resume(dist_pools, tmp_path):
    """lag 0 is the sync schedule, row for row; at lag 2 every token's age is what the schedule says (step s trains
    on version max(s - 2, 0)), the producer thread changes nothing (bitwise against producing after each step),
    and a run resumed from a checkpoint (which holds the 2 pending batches) equals the uninterrupted one, as does a
    finished run extended by raising train.steps."""
    from tests.helpers import TRAIN_DENSE as MODEL
    from tests.helpers import init_checkpoint, rank_train, train_cfg

    init = init_checkpoint(tmp_path, MODEL, dist_pools)

    def run(name, steps=4, resume=False, **rollout):
        cfg = train_cfg(MODEL, {}, init, rollout=rollout, steps=steps, checkpoint_every=2, keep_last=1)
        return dist_pools(1).run(rank_train, shared=(cfg, str(tmp_path / name), resume))[0]

    sync, _ = run("sync")
    lag0, _ = run("lag0", schedule="lagged", lag=0)
    assert _rows(lag0) == _rows(sync)
    lagged, state = run("lag2", schedule="lagged", lag=2)
    assert [r["rollout/token_age_mean"] for r in lagged[1:]] == [0, 1, 2, 2]
    assert [r["rollout/token_age_max"] for r in lagged[1:]] == [0, 1, 2, 2]
    assert all(r["rollout/mixed_version_frac"] == 0 for r in lagged[1:])
    assert lagged[1]["train/reward"] == sync[1]["train/reward"]  # batch 0: version 0's in both schedules
    assert lagged[3]["train/reward"] != sync[3]["train/reward"]  # batch 2: version 0's here, version 2's there
    assert "mismatch_start/age2/kl_k3" in lagged[3] and "divergence_start/age2/outside_frac" in lagged[3]
    assert 0 <= lagged[3]["perf/trainer_idle_frac"] <= 1
    sequential, seq_state = run("lag2-sequential", schedule="lagged", lag=2, overlap=False)
    assert _rows(sequential) == _rows(lagged)
    assert all(torch.equal(seq_state[k], state[k]) for k in state)
    (tmp_path / "lag2-resumed").mkdir()
    (tmp_path / "lag2-resumed" / STOP_FILE).touch()  # checkpoint after step 1, while batch 2 is generated, and stop
    stopped, _ = run("lag2-resumed", schedule="lagged", lag=2)
    assert [r["step"] for r in stopped] == [0, 1]
    (tmp_path / "lag2-resumed" / STOP_FILE).unlink()
    resumed, res_state = run("lag2-resumed", resume=True, schedule="lagged", lag=2)
    assert _rows(resumed) == _rows(lagged)
    assert all(torch.equal(res_state[k], state[k]) for k in state)
    # a finished run extended (train.steps raised, --resume): its producer ran ahead as a longer run's does, so its
    # last checkpoint holds batches 2 and 3 of versions 0 and 1 (regression: none, made anew from version 2)
    run("lag2-extended", steps=2, schedule="lagged", lag=2)
    extended, ext_state = run("lag2-extended", resume=True, schedule="lagged", lag=2)
    assert _rows(extended) == _rows(lagged)
    assert all(torch.equal(ext_state[k], state[k]) for k in state)


def test_lagged_schedule_config_checks(caplog):
    """Colocated engines cannot overlap generation with training: refused at load, naming the fields; stale
    rollouts under ratio clipping alone get a warning (miles #1829), under PDM none."""
    from megatron_pdm.train.config import RolloutConfig, config_from_dict

    with pytest.raises(ValueError, match=r"rollout.schedule: 'lagged' .*\(rollout.sglang.release_memory"):
        RolloutConfig(engine="sglang", sglang={"num_engines": 1, "release_memory": True}, schedule="lagged")
    with pytest.raises(ValueError, match="rollout.schedule: 'async' is not one of"):
        RolloutConfig(schedule="async")
    with pytest.raises(ValueError, match="rollout.lag"):
        RolloutConfig(schedule="lagged", lag=-1)
    base = {"data": {"task": "arithmetic"}, "rollout": {"schedule": "lagged", "lag": 2}}
    with caplog.at_level("WARNING"):
        assert config_from_dict({**base, "objective": {"mask": "pdm"}}).lag == 2
        assert "stale rollouts" not in caplog.text
        config_from_dict({**base, "objective": {"mask": "ppo"}})
        assert "stale rollouts under objective.mask 'ppo'" in caplog.text
    assert config_from_dict({"rollout": {"lag": 2}}).lag == 0  # the sync schedule has no lag


@pytest.mark.e2e
def test_aborted_requests_keep_their_partial_output_over_loopback(tmp_path):
    """SGLang answers a request aborted mid-generation with the tokens it generated: with partial rollouts the
    client keeps them as partial samples (finish "abort", versions from the spans) and `extend` completes them to
    the tokens of an uninterrupted generation (`serve` over loopback, its abort hook); without, they are sent
    again."""
    from megatron_pdm.rollout.sglang.client import SGLangEngine
    from megatron_pdm.rollout.sglang.pool import post
    from tests.helpers import _in_process_server

    _, url, stop = _in_process_server(tmp_path, DENSE, test_hooks=True)
    try:
        engine = SGLangEngine(sglang_section(urls=[url], timeout_s=30), DENSE, weight_dir=tmp_path / "w")
        engine.wait_ready(30)
        engine.weight_version = 0
        params = replace(PARAMS, max_new_tokens=5, stop_token_ids=())
        whole = engine.generate(PROMPTS, params)
        post(url, "/megatron_pdm/faults", {"abort_generates": 2, "abort_after": 2}, 10)
        cut = engine.generate(PROMPTS, replace(params, partial=True))
        # one request per prompt, sent concurrently: which two arrive first (and are aborted) is up to the threads
        finish = [s.finish_reason for s in cut]
        assert sorted(finish) == ["abort"] * 4 + ["length"] * 2 and finish[0::2] == finish[1::2]  # n=2 per prompt
        assert [len(s.response_ids) for s in cut] == [2 if f == "abort" else 5 for f in finish]
        assert all(s.versions().tolist() == [0] * len(s.response_ids) for s in cut)  # from the spans
        done = engine.extend(cut, params)
        for s, w in zip(done, whole, strict=True):
            s.check()
            assert torch.equal(s.response_ids, w.response_ids) and s.finish_reason == "length"
        # without partial (the sync and lagged schedules, evaluation): an aborted request is sent again, never kept
        post(url, "/megatron_pdm/faults", {"abort_generates": 1, "abort_after": 2}, 10)
        assert all(torch.equal(s.response_ids, w.response_ids) for s, w in
                   zip(engine.generate(PROMPTS, params), whole, strict=True))
    finally:
        stop()


def test_streaming_schedule_bounds_ages_and_resumes(dist_pools, tmp_path):
    """streaming, max_staleness 1, segments of 2 of 3 tokens: no token older than 1 version, samples spanning two
    versions (cut by an update, continued under the next weights), bitwise the same with the producer thread as
    without, and a run resumed from a checkpoint (which holds the buffer and its partial samples) equals the
    uninterrupted one, as does a finished run extended by raising train.steps; max_token_age 0 leaves every older
    token out of the loss."""
    from tests.helpers import TRAIN_DENSE as MODEL
    from tests.helpers import init_checkpoint, rank_train, train_cfg

    init = init_checkpoint(tmp_path, MODEL, dist_pools)

    def run(name, steps=4, resume=False, objective=None, **rollout):
        cfg = train_cfg(MODEL, {}, init, objective=objective, rollout={"schedule": "streaming", "max_staleness": 1,
                                                                   **rollout},
                   steps=steps, checkpoint_every=2, keep_last=1)
        return dist_pools(1).run(rank_train, shared=(cfg, str(tmp_path / name), resume))[0]

    rows, state = run("stream")
    assert all(r["rollout/token_age_max"] <= 1 for r in rows[1:])
    assert max(r["rollout/token_age_max"] for r in rows[1:]) == 1
    assert max(r["rollout/mixed_version_frac"] for r in rows[1:]) > 0
    assert any(r["mismatch_start/age1/kl_k3"] is not None for r in rows[1:])
    sequential, seq_state = run("stream-sequential", overlap=False)
    assert _rows(sequential) == _rows(rows)
    assert all(torch.equal(seq_state[k], state[k]) for k in state)
    (tmp_path / "stream-resumed").mkdir()
    (tmp_path / "stream-resumed" / STOP_FILE).touch()
    assert [r["step"] for r in run("stream-resumed")[0]] == [0, 1]
    (tmp_path / "stream-resumed" / STOP_FILE).unlink()
    resumed, res_state = run("stream-resumed", resume=True)
    assert _rows(resumed) == _rows(rows)
    assert all(torch.equal(res_state[k], state[k]) for k in state)
    # a finished run extended (train.steps raised, --resume): its last step ran the round of its version, as a longer
    # run's does, so its last checkpoint holds that round's buffer (regression: the round ran at version 2 instead)
    run("stream-extended", steps=2)
    extended, ext_state = run("stream-extended", resume=True)
    assert _rows(extended) == _rows(rows)
    assert all(torch.equal(ext_state[k], state[k]) for k in state)
    # resumed under another schedule: the buffer is not its own, so it is dropped (a warning) and generated anew
    other, _ = run("stream-resumed", steps=5, resume=True, schedule="lagged", lag=1)
    assert other[-1]["step"] == 5 and other[-1]["rollout/token_age_mean"] == 0
    newest, _ = run("stream-newest", objective={"max_token_age": 0})
    assert all(r.get("mismatch/age1/kl_k3") is None for r in newest[1:])  # age-1 tokens never reach the loss
    assert any(r.get("mismatch/age0/kl_k3") is not None for r in newest[1:])
    assert all(("train/empty_minibatches" in r) == (r["rollout/token_age_mean"] == 1) for r in newest[1:])


def test_lagged_steps_without_informative_groups_keep_the_schedule(dist_pools, tmp_path):
    """A step that trains nothing (dynamic sampling found no informative group) still lets the producer finish
    (regression: the early return skipped the producer's settle, so batch 2 was overwritten by batch 3 and step 2
    found no batch)."""
    from tests.helpers import TRAIN_DENSE as MODEL
    from tests.helpers import init_checkpoint, rank_train, train_cfg

    init = init_checkpoint(tmp_path, MODEL, dist_pools)
    (tmp_path / "zero.py").write_text("def reward(response, answer, metadata):\n    return 0.0\n")
    cfg = train_cfg(MODEL, {}, init, rollout={"schedule": "lagged", "lag": 2}, steps=4, filter_groups="zero_variance",
               max_tokens_per_microbatch=64)
    cfg = replace(cfg, data=replace(cfg.data, reward=f"{tmp_path / 'zero.py'}:reward"))
    rows, _ = dist_pools(1).run(rank_train, shared=(cfg, str(tmp_path / "run")))[0]
    assert [r.get("train/no_informative_group") for r in rows[1:]] == [1] * 4  # all 4 steps ran


def test_proximal_anchor_centres_the_trust_region_on_pi_old():
    """objective.anchor proximal: D, Ddot and the mask's ratio test against pi_old on mu's top-K ids. With pi_old
    = pi (one update per step), D = 0 and every mask keeps every token, however stale mu is; the loss's ratio
    stays pi / mu (no correction) and the mismatch diagnostics stay mu's. support_logprobs is log_softmax at the
    ids (float64 reference)."""
    from megatron_pdm.objectives import ObjectiveConfig, policy_loss
    from megatron_pdm.vocab_parallel import BehaviorTopK, support_logprobs, token_logprobs

    g = torch.Generator().manual_seed(7)
    T, V, K = 64, 50, 8
    logits = torch.randn(T, V, generator=g, dtype=torch.float64) * 2
    stale = logits + torch.randn(T, V, generator=g, dtype=torch.float64) * 1.5  # a stale mu, far from pi
    mu = torch.log_softmax(stale, -1)
    ids = torch.multinomial(mu.exp(), 1, generator=g).squeeze(1)
    top = mu.topk(K, -1)
    behavior = BehaviorTopK(ids, mu.gather(1, ids[:, None]).squeeze(1), top.indices, top.values)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(support_logprobs(logits, top.indices), ref.gather(1, top.indices), rtol=0, atol=1e-12)
    anchor = BehaviorTopK(ids, token_logprobs(logits, ids), top.indices, support_logprobs(logits, top.indices))
    adv = torch.randn(T, generator=g, dtype=torch.float64)
    ones = torch.ones(T, dtype=torch.float64)
    for mask in ("ppo", "dppo", "pdm"):
        cfg = ObjectiveConfig(mask=mask, top_k=K)
        plain = policy_loss(logits, behavior, adv, ones, cfg, temperature=1.0, normalizer=T)
        centred = policy_loss(logits, behavior, adv, ones, cfg, temperature=1.0, normalizer=T, anchor=anchor)
        assert float((~plain.mask.keep).double().mean()) > 0.05  # the stale mu masks tokens
        assert bool(centred.mask.keep.all()) and float(centred.stats.divergence.abs().max()) < 1e-12
        kept = plain.mask.keep.double()
        torch.testing.assert_close(centred.per_token_loss * kept, plain.per_token_loss, rtol=1e-12, atol=1e-12)
        assert centred.metrics.reduce()["mismatch/kl_k3"] == plain.metrics.reduce()["mismatch/kl_k3"]


def test_proximal_anchor_keeps_every_token_in_training(dist_pools, tmp_path):
    """In a run (lag 2, one minibatch, a TIS correction): pi_old is pi at the only update, so nothing is masked."""
    from tests.helpers import TRAIN_DENSE as MODEL
    from tests.helpers import init_checkpoint, rank_train, train_cfg

    init = init_checkpoint(tmp_path, MODEL, dist_pools)
    cfg = train_cfg(MODEL, {}, init, objective={"anchor": "proximal", "correction": "tis", "mask": "pdm"},
               rollout={"schedule": "lagged", "lag": 2}, steps=3, minibatches=1, micro_batch_size=16)
    rows, _ = dist_pools(1).run(rank_train, shared=(cfg, str(tmp_path / "run")))[0]
    assert [r["mask/masked_frac"] for r in rows[1:]] == [0.0, 0.0, 0.0]
    assert rows[3]["rollout/token_age_mean"] == 2 and rows[3]["mismatch_start/age2/kl_k3"] > 0


def test_a_failure_past_the_runs_end_leaves_the_last_checkpoint(caplog):
    """Review of issue 49 item 3: the producer runs past train.steps (batches only a longer, resumed run trains on),
    and the last step's weight sync waited for that work; when it failed (an engine gone, a reward server down), the
    error ended the run before its last checkpoint. Now it warns and the checkpoint lacks those batches (a resumed
    longer run makes them again); a failure within the run still ends it. The schedule's side of `Rollouts`
    (produce, publish) is written out here: the failure must come from the producer, at a chosen batch."""
    from megatron_pdm.train.rollouts import Produced
    from megatron_pdm.train.schedule import LaggedSchedule

    class Rollouts:
        engine = "an engine"  # rank 0: producing

        def produce(self, step):
            if step >= 2:
                raise ConnectionError(f"engine gone at batch {step}")
            return Produced(step, [], torch.zeros(0), torch.zeros(0, 2, dtype=torch.long), 0, {})

        def publish(self, produced):
            return produced

    for overlap in (True, False):
        sched = LaggedSchedule(Rollouts(), lag=1, overlap=overlap, steps=2, n=1, prompts_per_step=1)
        try:
            sched.start(0)
            sched.take(0)
            sched.settle()  # batch 1, within the run
            sched.take(1)  # launches batch 2: past the run's end
            with caplog.at_level("WARNING"):
                sched.settle()  # was: ConnectionError, and no checkpoint at step 2
            assert "failed (ConnectionError: engine gone at batch 2)" in caplog.text
            assert sched.state()["batches"] == []
        finally:
            sched.close()
        caplog.clear()
        sched = LaggedSchedule(Rollouts(), lag=1, overlap=overlap, steps=5, n=1, prompts_per_step=1)
        try:
            sched.start(0)
            sched.take(0)
            sched.settle()
            sched.take(1)  # batch 2 is within a 5-step run: its failure ends the run
            with pytest.raises(ConnectionError, match="batch 2"):
                sched.settle()
        finally:
            sched.close()
