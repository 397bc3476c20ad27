"""Rollout samples to training batches: rows, tokens and positions; token-budget micro-batches; dynamic sampling;
and the trainer's batch path on another device under FakeTensorMode (a CPU tensor meeting it raises)."""

import contextlib
import dataclasses
import signal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_pdm.objectives import ObjectiveConfig, loss_normalizer, policy_loss
from megatron_pdm.rollout import RolloutSample
from megatron_pdm.train.batch import (
    Batch,
    informative_groups,
    overlong_penalty,
    pack_by_tokens,
    plan_micro_batches,
    plan_minibatches,
    rollout_batch,
)
from megatron_pdm.vocab_parallel import BehaviorTopK

V, K = 64, 4


def _samples(n=6, seed=0) -> list[RolloutSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = 2 + i % 3
        lp = torch.log_softmax(torch.randn(L, V, generator=g), -1)
        ids = torch.randint(0, V, (L,), generator=g)
        top = lp.topk(K, -1)
        out.append(RolloutSample(i // 2, [1, 2, 3 + i] + [5] * (i % 2), ids, lp.gather(1, ids[:, None])[:, 0],
                                 top.indices, top.values, "length" if i == 4 else "stop", 0))
    return out


def test_batch_rows_tokens_and_positions():
    samples = _samples()
    adv = torch.arange(6, dtype=torch.float32)
    b = rollout_batch(samples, adv, pad_id=0, multiple=4, vocab_size=V,
                      in_loss=[s.finish_reason != "length" for s in samples])
    assert b.width % 4 == 0 and b.num_tokens == sum(len(s.response_ids) for s in samples)
    for n in range(b.num_tokens):  # each target is the token that the logits at its position predict
        assert b.input_ids[b.sequence_ids[n], b.positions[n] + 1] == b.targets[n]
        assert b.advantages[n] == adv[b.sequence_ids[n]]
        assert b.loss_mask[n] == (0.0 if b.sequence_ids[n] == 4 else 1.0)  # the truncated response is masked
    mb = b.select(2, 5)
    assert mb.rows == 3 and mb.sequence_ids.tolist() == (b.sequence_ids[b.offsets[2]:b.offsets[5]] - 2).tolist()
    assert torch.equal(mb.behavior.token_ids, mb.targets) and mb.num_tokens == b.offsets[5] - b.offsets[2]
    assert mb.width == 8 and b.select(0, 1).width == 8 and b.select(0, 1).real_tokens == 5
    assert [m.rows for m in b.micro_batches(4)] == [4, 2] and [m.rows for m in b.split([1, 3, 2])] == [1, 3, 2]
    moved = b.to(torch.device("meta"))
    assert all(t.device.type == "meta" for t in (moved.input_ids, moved.targets, moved.behavior.topk_logprobs,
                                                 moved.advantages, moved.loss_mask))


def test_token_budget_packing_and_balanced_ranks():
    g = torch.Generator().manual_seed(0)
    lengths = (torch.randn(200, generator=g) + 3.5).exp().round().clamp(1, 400).long().tolist()
    bins = pack_by_tokens(lengths, budget=1600)
    assert sorted(i for b in bins for i in b) == list(range(200))
    for b in bins:
        rows, longest = len(b), max(lengths[i] for i in b)
        assert rows == 1 or rows * longest <= 1600  # the budget bounds the positions a forward computes
        assert rows == 1 or sum(lengths[i] for i in b) >= 0.95 * rows * longest  # padding <= 5%
    for ranks in (1, 2, 3, 8):
        plan = plan_micro_batches(lengths, 1600, ranks)
        assert len({len(p) for p in plan}) == 1  # every rank runs the same number of micro-batches
        assert sorted(i for p in plan for b in p for i in b) == list(range(200))
        load = [sum(lengths[i] for b in p for i in b) for p in plan]
        assert max(load) - min(load) <= max(lengths)  # balanced by tokens, within one sequence
    assert plan_micro_batches([5, 1], 100, 2) == [[[0]], [[1]]]  # one bin halved so that both ranks get one
    # every sequence alone in its bin and 3 bins for 2 ranks: the two shortest share one (regression: max() of
    # nothing splittable)
    plan = plan_micro_batches([1000, 900, 800], 1000, 2)
    assert sorted(sorted(b) for p in plan for b in p) == [[0], [1, 2]]


@contextlib.contextmanager
def _deadline(seconds: int):
    """Fail (instead of hanging the suite) when the block runs longer than `seconds`: the planner once cycled
    forever."""
    def fail(*_):
        raise TimeoutError(f"did not return within {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _check_plan(plan, lengths, ranks):
    assert len(plan) == ranks and len({len(p) for p in plan}) == 1 and plan[0]  # same count, at least one each
    assert sorted(i for p in plan for b in p for i in b) == list(range(len(lengths)))  # every row exactly once


def test_token_budget_plan_terminates_at_any_row_count():
    """Regression: at DP >= 3, row counts where neither n nor n - 1 is a multiple of DP made the planner halve one
    bin and merge two forever (every rank hung at step 1); dynamic sampling produces such counts by itself."""
    with _deadline(20):
        _check_plan(plan_micro_batches([7, 7, 7, 7, 7], 7, 3), [7] * 5, 3)  # 5 singles at DP 3
        lengths = [30] * 12  # 12 rows, 2 minibatches, DP 4: 6 rows per minibatch
        for mb in plan_minibatches(lengths, minibatches=2, ranks=4, micro_batch_size=1, max_tokens=30):
            assert len(mb) == 4 and len({len(sizes) for _, sizes in mb}) == 1
            assert sum(len(rows) for rows, _ in mb) == 6


def test_token_budget_merge_takes_the_cheapest_pair():
    """Regression: the merge took the two bins with the fewest positions each, so a short multi-row bin joined a
    long single row and was padded to it: 16 rows of 9,000 tokens and 8 of 500 at DP 16 under a 16,384 budget gave
    one micro-batch of 9 x 9,000 = 81,000 positions, where merging two long rows computes 18,000."""
    lengths = [9000] * 16 + [500] * 8
    plan = plan_micro_batches(lengths, 16384, 16)
    _check_plan(plan, lengths, 16)
    worst = max(len(b) * max(lengths[i] for i in b) for p in plan for b in p)
    assert worst == 18000


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(1, 60), min_size=1, max_size=4), min_size=2, max_size=9))
def test_cheapest_merge_equals_the_best_of_every_pair(bin_lengths):
    """The one-pass merge choice computes what a search over every pair of bins finds."""
    import itertools

    from megatron_pdm.train.batch import _cheapest_merge

    lengths = [n for b in bin_lengths for n in b]
    ids = iter(range(len(lengths)))
    bins = [sorted((next(ids) for _ in b), key=lambda i: (-lengths[i], i)) for b in bin_lengths]
    cost = lambda a, b: (len(a) + len(b)) * max(lengths[a[0]], lengths[b[0]])  # noqa: E731
    assert cost(*_cheapest_merge(bins, lengths)) == min(cost(a, b) for a, b in itertools.combinations(bins, 2))


@settings(derandomize=True, max_examples=400, deadline=None)
@given(st.integers(1, 8).flatmap(lambda ranks: st.tuples(
    st.just(ranks), st.lists(st.integers(1, 300), min_size=ranks, max_size=40), st.integers(1, 1200))))
def test_token_budget_plan_properties(case):
    """Any row count >= DP, any DP size, any lengths and budget: the plan ends, places every row in exactly one
    micro-batch and gives every rank the same number of micro-batches (at least one)."""
    ranks, lengths, budget = case
    with _deadline(20):
        plan = plan_micro_batches(lengths, budget, ranks)
    _check_plan(plan, lengths, ranks)
    if len(lengths) >= 3 * ranks:  # virtual stages at PP 3: every rank gets at least 3 micro-batches
        plan = plan_micro_batches(lengths, budget, ranks, per_rank=3)
        _check_plan(plan, lengths, ranks)
        assert len(plan[0]) >= 3


def test_token_budgets_give_every_rank_pipeline_many_micro_batches():
    """Regression: virtual pipeline stages with token budgets loaded, then crashed at the first step where a rank's
    bins held fewer rows than PP (`at_least`: "the interleaved schedule needs at least parallel.pipeline = 3
    micro-batches"). Two long rows and six short ones at DP 2: balanced by tokens, a rank got one long row alone."""
    from megatron_pdm.train.step import at_least

    lengths = [100, 100, 10, 10, 10, 10, 10, 10]
    for mb in plan_minibatches(lengths, minibatches=1, ranks=2, micro_batch_size=1, max_tokens=100, per_rank=3):
        fewest = min(sum(sizes) for _, sizes in mb)
        for _, sizes in mb:
            assert len(sizes) >= 3 and len(at_least(sizes, 3, fewest=fewest)) >= 3
    # too few rows for two minibatches of 2 x 3: one minibatch; fewer than 2 x 3 rows: none (the trainer skips)
    assert len(plan_minibatches(lengths, minibatches=2, ranks=2, micro_batch_size=1, max_tokens=100,
                                per_rank=3)) == 1
    assert plan_minibatches(lengths[:5], minibatches=1, ranks=2, micro_batch_size=1, max_tokens=100,
                            per_rank=3) == []


def test_dynamic_sampling_helpers():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert informative_groups(rewards, 2).tolist() == [False, True, False]
    pen = overlong_penalty(torch.tensor([10, 12, 14, 16]), max_new_tokens=16, buffer=4, factor=0.5)
    assert pen.tolist() == [0.0, 0.0, -0.25, -0.5]  # DAPO: 0, then linear down to -factor at L_max


def _fake_on(batch: Batch, device: str) -> Batch:
    """The batch as fake tensors on `device` (what `batch.to(device)` gives; made inside the fake mode)."""
    like = lambda t: None if t is None else torch.empty(t.shape, dtype=t.dtype, device=device)  # noqa: E731
    b = batch.behavior
    return dataclasses.replace(batch, input_ids=like(batch.input_ids), sequence_ids=like(batch.sequence_ids),
                               positions=like(batch.positions), targets=like(batch.targets),
                               behavior=BehaviorTopK(*(like(t) for t in (b.token_ids, b.token_logprobs, b.topk_ids,
                                                                         b.topk_logprobs))),
                               advantages=like(batch.advantages), loss_mask=like(batch.loss_mask))


# a non-CPU device: "meta" here (fake "cuda" tensors cannot be indexed on a CPU-only torch), "cuda" with a GPU
DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_trainer_batch_path_on_another_device(aggregation, device):
    """The trainer's micro-batch path on a non-CPU device, under FakeTensorMode (a CPU tensor beside the inputs
    raises a device mismatch, a value read on the host raises too): batch -> response logits -> normaliser ->
    loss -> backward."""
    host = rollout_batch(_samples(), torch.randn(6, generator=torch.Generator().manual_seed(1)), pad_id=0,
                         multiple=2, vocab_size=V)
    cfg = ObjectiveConfig(aggregation=aggregation)
    with FakeTensorMode(allow_non_fake_inputs=False):
        b = _fake_on(host, device)
        logits = torch.empty(b.rows, b.width, V, device=device, requires_grad=True)
        norm = loss_normalizer(b.loss_mask, b.sequence_ids, aggregation)
        for mb in b.micro_batches(4):
            z = mb.response_logits(logits[: mb.rows, : mb.width])
            out = policy_loss(z, mb.behavior, mb.advantages, mb.loss_mask, cfg, temperature=1.0, normalizer=norm,
                              sequence_ids=mb.sequence_ids)
            out.loss.backward()
            assert out.loss.device.type == device
        assert logits.grad.device.type == device


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_context_shards_partition_the_tokens_and_the_loss(aggregation, cp):
    """Context-parallel shards (chunks r and 2cp-1-r of 2cp): every response token lands on exactly one rank, at
    the local column of its global position, and the shards' losses and logits gradients add up to the whole
    micro-batch's, in float64 (tolerance: summation order only)."""
    host = rollout_batch(_samples(), torch.randn(6, generator=torch.Generator().manual_seed(2)), pad_id=0,
                         multiple=2 * cp, vocab_size=V, in_loss=[True, True, False, True, True, True])
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(host.rows, host.width, V, generator=g, dtype=torch.float64, requires_grad=True)
    cfg = ObjectiveConfig(aggregation=aggregation, mask="pdm")
    norm = loss_normalizer(host.loss_mask, host.sequence_ids, aggregation)
    loss = lambda b, z, **kw: policy_loss(b.response_logits(z), b.behavior, b.advantages, b.loss_mask, cfg,  # noqa: E731
                                          temperature=1.0, normalizer=norm, sequence_ids=b.sequence_ids, **kw).loss
    (full_grad,) = torch.autograd.grad(loss(host, logits), logits)
    full = loss(host, logits.detach())
    seen, total, grad = [], 0.0, torch.zeros_like(logits)
    for r in range(cp):
        s = host.context_shard(r, cp)
        chunk = host.width // (2 * cp)
        cols = torch.cat([c * chunk + torch.arange(chunk) for c in (r, 2 * cp - 1 - r)])
        assert s.width == host.width // cp and torch.equal(s.input_ids, host.input_ids[:, cols])
        assert s.num_tokens == len(s.targets) == len(s.behavior.topk_ids)
        seen += list(zip(s.sequence_ids.tolist(), cols[s.positions].tolist(), strict=True))
        z = logits.detach()[:, cols].requires_grad_()
        part = loss(s, z, sequence_lengths=s.sequence_lengths)
        total += float(part.detach())
        part.backward()
        grad[:, cols] += z.grad
    assert sorted(seen) == sorted(zip(host.sequence_ids.tolist(), host.positions.tolist(), strict=True))
    assert total == pytest.approx(float(full), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, full_grad, rtol=1e-12, atol=1e-15)
    meta = host.to(torch.device("meta")).context_shard(1, cp)  # device tensors stay where they are
    assert {t.device.type for t in (meta.input_ids, meta.positions, meta.targets, meta.sequence_lengths,
                                    meta.behavior.topk_logprobs, meta.advantages)} == {"meta"}
