"""Token-budget micro-batches, dynamic sampling and overlong responses in the trainer."""

import pytest
import torch

from tests.test_train import DENSE, _cfg, _init_checkpoint, rank_train


@pytest.fixture(scope="module")
def init(tmp_path_factory, dist_pools):
    return _init_checkpoint(tmp_path_factory.mktemp("init"), DENSE, dist_pools)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_token_budget_micro_batches_equal_one_big_batch(dist_pools, tmp_path, init, aggregation):
    """DP = 2: one micro-batch of every row per rank, against token-budget micro-batches with ranks balanced by
    tokens (other rows on each rank): the same loss and the same weights after the update, up to fp32 summation
    order (tolerance 1e-5 on weights, as the layout-parity tests)."""
    kw = dict(steps=1, minibatches=1, eval_every=1, checkpoint_every=1, prompts_per_step=8)
    obj = {"aggregation": aggregation}
    big = _cfg(DENSE, {}, init, objective=obj, micro_batch_size=16, **kw)
    budget = _cfg(DENSE, {}, init, objective=obj, micro_batch_size=1, max_tokens_per_microbatch=48, **kw)
    (rows_a, state_a), _ = dist_pools(2).run(rank_train, shared=(big, str(tmp_path / "big")))
    (rows_b, state_b), _ = dist_pools(2).run(rank_train, shared=(budget, str(tmp_path / "budget")))
    a, b = rows_a[1], rows_b[1]
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-7)
    assert b["train/reward"] == a["train/reward"] and b["perf/padding_frac"] <= 0.05 < a["perf/padding_frac"] + 1
    for k in state_a:
        torch.testing.assert_close(state_b[k], state_a[k], atol=1e-5, rtol=1e-5)


def test_filter_groups_refill_and_overlong(dist_pools, tmp_path, init):
    kw = dict(steps=2, minibatches=1, eval_every=2, checkpoint_every=2, prompts_per_step=4, micro_batch_size=8)
    refill = _cfg(DENSE, {}, init, filter_groups="zero_variance", refill=True, max_rollout_rounds=3, **kw)
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
        **_cfg(DENSE, {}, init, **short).to_dict(),
        "rollout": {"n": 4, "max_new_tokens": 1, "overlong": overlong, **rollout}})
    keep = dist_pools(1).run(rank_train, shared=(cut("keep"), str(tmp_path / "keep")))[0][0][1]
    masked = dist_pools(1).run(rank_train, shared=(cut("mask"), str(tmp_path / "mask")))[0][0][1]
    # at DP 2: every rank shapes the rewards from the broadcast lengths (rank 0 alone holds the samples)
    penal = dist_pools(2).run(rank_train, shared=(cut("penalty", overlong_buffer=1, overlong_penalty_factor=0.5),
                                                  str(tmp_path / "penalty")))[0][0][1]
    assert masked["train/reward"] == keep["train/reward"] and masked["train/loss"] != keep["train/loss"]
    assert penal["train/reward"] == pytest.approx(keep["train/reward"] - 0.5)


def test_dynamic_sampling_config_errors():
    from megatron_pdm.train.config import config_from_dict

    with pytest.raises(ValueError, match="train.refill: true needs train.filter_groups: zero_variance"):
        config_from_dict({"train": {"refill": True}})
    with pytest.raises(ValueError, match="train.filter_groups: dropping groups .* set train.max_tokens_per_microbatch"):
        config_from_dict({"train": {"filter_groups": "zero_variance"}})
    with pytest.raises(ValueError, match=r"rollout.overlong_buffer: 0 must be in \[1, rollout.max_new_tokens = 4\]"):
        config_from_dict({"rollout": {"overlong": "penalty"}})
