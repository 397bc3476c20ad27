"""Token-budget micro-batches, dynamic sampling and overlong responses in the trainer."""

from pathlib import Path

import pytest
import torch

from tests.helpers import TRAIN_DENSE, TRAIN_MOE, init_checkpoint, rank_train, train_cfg


@pytest.fixture(scope="module")
def init(tmp_path_factory, dist_pools):
    return init_checkpoint(tmp_path_factory.mktemp("init"), TRAIN_DENSE, dist_pools)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_token_budget_micro_batches_equal_one_big_batch(dist_pools, tmp_path, init, aggregation):
    """DP = 2: one micro-batch of every row per rank, against token-budget micro-batches with ranks balanced by
    tokens (other rows on each rank): the same loss and the same weights after the update, up to fp32 summation
    order (tolerance 1e-5 on weights, as the layout-parity tests)."""
    kw = dict(steps=1, minibatches=1, eval_every=1, checkpoint_every=1, prompts_per_step=8)
    obj = {"aggregation": aggregation}
    big = train_cfg(TRAIN_DENSE, {}, init, objective=obj, micro_batch_size=16, **kw)
    budget = train_cfg(TRAIN_DENSE, {}, init, objective=obj, micro_batch_size=1, max_tokens_per_microbatch=48, **kw)
    (rows_a, state_a), _ = dist_pools(2).run(rank_train, shared=(big, str(tmp_path / "big")))
    (rows_b, state_b), _ = dist_pools(2).run(rank_train, shared=(budget, str(tmp_path / "budget")))
    a, b = rows_a[1], rows_b[1]
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-7)
    assert b["train/reward"] == a["train/reward"] and b["perf/padding_frac"] <= 0.05 < a["perf/padding_frac"] + 1
    for k in state_a:
        torch.testing.assert_close(state_b[k], state_a[k], atol=1e-5, rtol=1e-5)


def test_filter_groups_refill_and_overlong(dist_pools, tmp_path, init):
    kw = dict(steps=2, minibatches=1, eval_every=2, checkpoint_every=2, prompts_per_step=4, micro_batch_size=8)
    refill = train_cfg(TRAIN_DENSE, {}, init, filter_groups="zero_variance", refill=True, max_rollout_rounds=3, **kw)
    rows = dist_pools(1).run(rank_train, shared=(refill, str(tmp_path / "refill")))[0][0]
    for r in rows[1:]:
        assert 1 <= r["rollout/rounds"] <= 3 and r["rollout/groups_dropped"] >= 0
        assert r["rollout/rounds"] == 3 or r["rollout/groups_dropped"] <= 4 * (r["rollout/rounds"] - 1) + 4
    d = refill.to_dict()
    d["train"].update(refill=False, max_tokens_per_microbatch=64)
    from megatron_pdm.train.config import config_from_dict

    rows = dist_pools(1).run(rank_train, shared=(config_from_dict(d), str(tmp_path / "filter")))[0][0]
    assert all(r["rollout/rounds"] == 1 for r in rows[1:])
    # overlong: with max_new_tokens 1 every response that did not stop at once is cut; mask drops those from the
    # loss (the batch's loss mask is tested in test_batch.py), penalty with a 1-token buffer subtracts the whole
    # factor from every 1-token response
    short = dict(kw, steps=1)
    cut = lambda overlong, **rollout: config_from_dict({  # noqa: E731
        **train_cfg(TRAIN_DENSE, {}, init, **short).to_dict(),
        "rollout": {"n": 4, "max_new_tokens": 1, "overlong": overlong, **rollout}})
    keep = dist_pools(1).run(rank_train, shared=(cut("keep"), str(tmp_path / "keep")))[0][0][1]
    masked = dist_pools(1).run(rank_train, shared=(cut("mask"), str(tmp_path / "mask")))[0][0][1]
    # at DP 2: every rank shapes the rewards from the broadcast lengths (rank 0 alone holds the samples)
    penal = dist_pools(2).run(rank_train, shared=(cut("penalty", overlong_buffer=1, overlong_penalty_factor=0.5),
                                                  str(tmp_path / "penalty")))[0][0][1]
    assert masked["train/reward"] == keep["train/reward"] and masked["train/loss"] != keep["train/loss"]
    assert penal["train/reward"] == pytest.approx(keep["train/reward"] - 0.5)


def test_minibatch_without_loss_tokens_leaves_weights_finite_and_unchanged(dist_pools, tmp_path, init):
    """Regression: a constant reward leaves no informative group, so refill tops the step up with dropped groups,
    which are out of the loss: the normaliser is 0 and loss = 0 / 0 wrote NaN into every weight through Adam (and
    into the checkpoint of that step). Now such a minibatch is skipped on every rank (DP 2): no optimizer step, the
    weights stay the initial ones bitwise, no loss is logged, and the checkpoint is published with finite weights."""
    from megatron_pdm.models import load_hf_checkpoint
    from megatron_pdm.train.checkpoint import complete_checkpoints
    from megatron_pdm.train.config import config_from_dict

    reward = tmp_path / "constant.py"
    reward.write_text("def score(response, answer, metadata):\n    return 0.0\n")
    cfg = train_cfg(TRAIN_DENSE, {}, init, filter_groups="zero_variance", refill=True, max_rollout_rounds=1, steps=1,
               minibatches=2, micro_batch_size=4, checkpoint_every=1, eval_every=1)
    cfg = config_from_dict({**cfg.to_dict(), "data": {**cfg.to_dict()["data"], "reward": f"{reward}:score"}})
    (rows, state), _ = dist_pools(2).run(rank_train, shared=(cfg, str(tmp_path / "run")))
    row = rows[1]
    assert row["rollout/topup_groups"] == 4 and row["train/empty_minibatches"] == 2 and "train/loss" not in row
    init_state, _ = load_hf_checkpoint(init)
    for k, v in init_state.items():
        assert torch.isfinite(state[k]).all() and torch.equal(state[k], v), k
    assert [p.name for p in complete_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000001"]


def test_checkpoint_with_nonfinite_weights_is_never_published(dist_pools, tmp_path):
    results = dist_pools(2).run(rank_save_nonfinite, shared=(str(tmp_path),))
    assert all("not published, the weights are not finite (decoder.layers.0" in r and "on rank 1" in r
               for r in results)
    from megatron_pdm.train.checkpoint import complete_checkpoints

    assert complete_checkpoints(tmp_path / "checkpoints") == []


def rank_save_nonfinite(group, root):
    """Rank 1's copy of a weight turns NaN (DP 2): save_checkpoint refuses on every rank, naming it."""
    import torch.distributed as dist

    from megatron_pdm.models import (
        ModelConfig,
        ParallelConfig,
        build_model_chunks,
        initialize_parallel,
    )
    from megatron_pdm.train.checkpoint import save_checkpoint

    with initialize_parallel(ParallelConfig(), seed=0) as ctx:
        chunks = build_model_chunks(ModelConfig(**TRAIN_DENSE), ctx)
        if dist.get_rank() == 1:
            with torch.no_grad():
                next(p for n, p in chunks[0].named_parameters() if n.startswith("decoder.layers.0")).view(-1)[3] = \
                    float("nan")
        try:
            save_checkpoint(Path(root) / "checkpoints", 1, chunks, None, trainer_state={}, keep_last=1, config={})
        except FloatingPointError as e:
            return str(e)
        return "published"


def test_dynamic_sampling_config_errors():
    from megatron_pdm.train.config import config_from_dict

    with pytest.raises(ValueError, match="train.refill: true needs train.filter_groups: zero_variance"):
        config_from_dict({"train": {"refill": True}})
    with pytest.raises(ValueError, match="train.filter_groups: dropping groups .* set train.max_tokens_per_microbatch"):
        config_from_dict({"train": {"filter_groups": "zero_variance"}})
    with pytest.raises(ValueError, match=r"rollout.overlong_buffer: 0 must be in \[1, rollout.max_new_tokens = 4\]"):
        config_from_dict({"rollout": {"overlong": "penalty"}})


def rank_fan_out(group, cfg, samples, rewards, lengths):
    """step_batches over TP 2 x DP 2 (replicas [0, 1] and [2, 3]): what each rank received, as host tensors."""
    import torch.distributed as dist

    from megatron_pdm.models import ParallelConfig, initialize_parallel
    from megatron_pdm.train.batch import batch_tensors
    from megatron_pdm.train.rollouts import step_batches

    with initialize_parallel(ParallelConfig(tensor=2)) as ctx:
        assert ctx.replicas == ((0, 1), (2, 3))
        got, received = step_batches(cfg, samples if dist.get_rank() == 0 else None, rewards, lengths, len(samples),
                                     ctx, pad_id=0, device=torch.device("cpu"))
    return [(batch_tensors(b)[0], sizes) for b, sizes in got], received


def test_two_level_fan_out_gives_every_rank_its_replicas_share(dist_pools):
    """Rank 0 sends each DP share to its replica's first rank, which broadcasts it over the replica: the two ranks of
    a replica hold the same share, the replicas hold disjoint shares covering every sample, and each row carries its
    own sample's tokens and routed experts (int16 on the wire, sent as bytes: gloo's broadcast and NCCL take no
    int16)."""
    from megatron_pdm.rollout import RolloutSample
    from megatron_pdm.train.config import config_from_dict

    cfg = config_from_dict({"model": TRAIN_MOE, "rollout": {"n": 2, "routed_experts": True},
                            "train": {"prompts_per_step": 4, "minibatches": 2, "micro_batch_size": 2}})
    g = torch.Generator().manual_seed(4)
    samples = []
    for i in range(8):
        prompt, L = [3, 4 + i % 4, 5], 2 + i % 3
        ids = torch.randint(0, 320, (L,), generator=g)
        lp = torch.log_softmax(torch.randn(L, 320, generator=g), -1)
        top = lp.topk(4, -1)
        routed = torch.randint(0, 4, (len(prompt) + L - 1, 2, 2), generator=g, dtype=torch.int32)
        samples.append(RolloutSample(i // 2, prompt, ids, lp.gather(1, ids[:, None])[:, 0], top.indices, top.values,
                                     "stop", 0, routed))
    rewards = torch.tensor([1.0, 0.0] * 4)
    lengths = torch.tensor([[len(s.prompt_ids), len(s.response_ids)] for s in samples])
    results = dist_pools(4).run(rank_fan_out, shared=(cfg, samples, rewards, lengths))
    assert [r[1] for r in results][0] == 0 and all(r[1] > 0 for r in results[1:])  # rank 0 keeps its own share
    seen = []
    for rank, (minibatches, _) in enumerate(results):
        peer = results[rank ^ 1][0]  # the other rank of the replica
        for (t, sizes), (u, peer_sizes) in zip(minibatches, peer, strict=True):
            assert sizes == peer_sizes and t.keys() == u.keys() and all(torch.equal(t[k], u[k]) for k in t)
            for row, ids in enumerate(t["input_ids"]):
                i = next(i for i, s in enumerate(samples) if ids[:len(s.prompt_ids) + len(s.response_ids)].tolist()
                         == s.prompt_ids + s.response_ids.tolist())
                n = len(samples[i].routed_experts)
                assert torch.equal(t["routed_experts"][row, :n], samples[i].routed_experts.long())
                if rank % 2 == 0:
                    seen.append(i)
    assert sorted(seen) == list(range(8))  # DP shares: disjoint, covering every sample
