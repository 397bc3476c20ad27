"""Masks, losses, advantages, diagnostics and the alignment hook against hand-built cases and float64 references."""

import math

import pytest
import torch

from megatron_pdm.objectives import (
    Metrics,
    ObjectiveConfig,
    alignment_rates,
    broadcast_to_tokens,
    dppo_mask,
    grpo_advantages,
    loss_normalizer,
    pdm_mask,
    policy_loss,
    ppo_mask,
    rloo_advantages,
)
from megatron_pdm.vocab_parallel import BehaviorTopK, policy_statistics
from tests.helpers import CONFIGS, SEQUENCE_CONFIGS, ref_loss
from tests.reference import make_case, ref_logpi


def _full_support_behavior(mu, k):
    """A top-K view with K = V (no tail), so the top-K KL is the exact KL."""
    V = mu.shape[-1]
    lm = mu.log()
    ids = torch.arange(V).expand(mu.shape[0], V).contiguous()
    return BehaviorTopK(k, lm.gather(1, k[:, None]).squeeze(-1), ids, lm)


def test_dppo_masks_and_pdm_keeps_and_the_reverse():
    # pi has over-sharpened its head relative to mu; token 1 has a slightly raised ratio (r = 1.1), yet a step
    # on it lowers KL(mu||pi) because it takes mass from the inflated head: Ddot = 0.005 - 0.2630... < 0.
    pi = torch.tensor([[0.9, 0.055, 0.03, 0.015]] * 2, dtype=torch.float64)
    mu = torch.tensor([[0.6, 0.05, 0.2, 0.15]] * 2, dtype=torch.float64)
    k = torch.tensor([1, 1])
    behavior = _full_support_behavior(mu, k)
    stats = policy_statistics(pi.log(), behavior, "topk_kl")
    ddot = (0.055 - 0.05) + (0.9 * -0.3 + 0.055 * -0.005 + 0.03 * 0.17 + 0.015 * 0.135)
    torch.testing.assert_close(stats.predicted_change, torch.full((2,), ddot, dtype=torch.float64))
    kl = sum(m * math.log(m / p) for m, p in zip(mu[0].tolist(), pi[0].tolist(), strict=True))
    torch.testing.assert_close(stats.divergence, torch.full((2,), kl, dtype=torch.float64))
    A = torch.tensor([1.0, -1.0], dtype=torch.float64)
    log_ratio = stats.logprobs - stats.behavior_logprobs
    dppo = dppo_mask(stats.divergence, log_ratio, A, delta=0.15)
    pdm = pdm_mask(stats.divergence, stats.predicted_change, A, delta=0.15)
    assert dppo.keep.tolist() == [False, True]  # A > 0, r > 1: DPPO masks; A < 0: DPPO keeps
    assert pdm.keep.tolist() == [True, False]  # PDM predicts the step lowers D for A > 0 and raises it for A < 0
    # inside the trust region nothing is masked
    assert pdm_mask(stats.divergence, stats.predicted_change, A, delta=1.0).keep.all()


@pytest.mark.parametrize("kind", ["binary_tv", "binary_kl"])
def test_pdm_on_binary_divergence_equals_dppo(kind):
    case = make_case(200, 50, 5, dtype=torch.float64, noise=1.5)
    A = torch.randn(200, dtype=torch.float64)
    s = policy_statistics(case.logits, case.topk, kind)
    log_ratio = s.logprobs - s.behavior_logprobs
    delta = float(s.divergence.median())
    a = dppo_mask(s.divergence, log_ratio, A, delta=delta)
    b = pdm_mask(s.divergence, s.predicted_change, A, delta=delta)
    assert (~a.keep).sum() > 10
    assert torch.equal(a.keep, b.keep)


def test_ppo_mask_matches_the_clip_definition_at_the_boundaries():
    eps_low, eps_high, tiny = 0.2, 0.28, 1e-9
    r = torch.tensor([1 + eps_high - tiny, 1 + eps_high + tiny, 1 - eps_low + tiny, 1 - eps_low - tiny, 1.0] * 2,
                     dtype=torch.float64)
    A = torch.tensor([1.0] * 5 + [-1.0] * 5, dtype=torch.float64)
    m = ppo_mask(r.log(), A, eps_low=eps_low, eps_high=eps_high)
    assert m.keep.tolist() == [True, False, True, True, True, True, True, True, False, True]
    assert m.proximity.tolist() == [False, True, False, True, False] * 2
    # the same decision as the gradient of PPO's clipped surrogate min(r A, clip(r) A)
    logp = r.log().clone().requires_grad_(True)
    rr = logp.exp()
    torch.minimum(rr * A, rr.clamp(1 - eps_low, 1 + eps_high) * A).sum().backward()
    assert torch.equal(m.keep, logp.grad != 0)


# ---------------------------------------------------------------------------------------------- loss vs reference


def rank_loss(group, case, A, loss_mask, seq_ids, config, normalizer, ref_lp=None, ref_z=None):
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    z, topk, _ = case.shard(rank, world)
    z = z.detach().clone().requires_grad_(True)
    width = z.shape[1]
    ref_shard = None if ref_z is None else ref_z[:, rank * width:(rank + 1) * width]
    out = policy_loss(z, topk, A, loss_mask, config, temperature=case.temperature, normalizer=normalizer,
                      sequence_ids=seq_ids, ref_logprobs=ref_lp if config.kl_coef else None,
                      ref_logits=ref_shard if config.kl_type == "exact" else None, tp_group=group)
    out.loss.backward()
    return out.loss.detach(), z.grad, out.mask.keep


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.mask}-{c.divergence}-{c.loss}-{c.aggregation}"
                         + (f"-kl_{c.kl_type}{'_unbiased' if c.kl_unbiased else ''}" if c.kl_coef else "")
                         + (f"-entropy{c.entropy_coef}" if c.entropy_coef else ""))
def test_loss_gradient_matches_float64_reference_at_tp2(dist_pools, config):
    T = 40
    g = torch.Generator().manual_seed(3)
    case = make_case(T, 2 * 23, 5, dtype=torch.float64, noise=1.0, seed=5)
    A = torch.randn(T, dtype=torch.float64, generator=g)
    loss_mask = (torch.rand(T, generator=g) > 0.2).float()
    seq_ids = torch.arange(T) // 8
    # log pi_ref(k): the policy's logits moved by noise, so that d = log pi - log pi_ref spreads over both signs
    ref_z = case.logits + torch.randn(case.logits.shape, dtype=torch.float64, generator=g)
    ref_lp = ref_logpi(ref_z, case.temperature).gather(1, case.topk.token_ids[:, None]).squeeze(-1)
    normalizer = float(loss_normalizer(loss_mask, seq_ids, config.aggregation))
    ref, ref_grad = ref_loss(case, A, loss_mask, seq_ids, config, normalizer, ref_lp, ref_z)
    results = dist_pools(2).run(rank_loss, shared=(case, A, loss_mask, seq_ids, config, normalizer, ref_lp, ref_z))
    grad = torch.cat([g for _, g, _ in results], dim=1)
    for loss, _, keep in results:
        torch.testing.assert_close(loss, ref, atol=1e-12, rtol=1e-10)
        assert torch.equal(keep, results[0][2])
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=1e-10)
    if config.mask != "ppo":
        assert (~results[0][2]).any(), "the case should mask some tokens"


@pytest.mark.parametrize("config", CONFIGS[:1] + CONFIGS[3:4], ids=lambda c: f"{c.mask}-{c.loss}")
def test_loss_divides_the_logits_by_the_sampling_temperature(config):
    """pi = softmax(z / T) at the temperature mu was sampled at, passed to the loss (rollout.temperature in a run)."""
    T = 40
    case = make_case(T, 30, 5, temperature=0.7, dtype=torch.float64, noise=1.0, seed=7)
    A = torch.randn(T, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    loss_mask, seq_ids = torch.ones(T), torch.arange(T) // 8
    ref, ref_grad = ref_loss(case, A, loss_mask, seq_ids, config, float(T))
    z = case.logits.detach().clone().requires_grad_(True)
    out = policy_loss(z, case.topk, A, loss_mask, config, temperature=case.temperature, normalizer=float(T))
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(z.grad, ref_grad, atol=1e-12, rtol=1e-10)
    at_one = policy_loss(case.logits, case.topk, A, loss_mask, config, temperature=1.0, normalizer=float(T))
    assert not torch.allclose(at_one.loss, ref)


def rank_dp_loss(group, case, A, loss_mask, seq_ids, config, bounds):
    import torch.distributed as dist

    rank = dist.get_rank(group)
    lo, hi = bounds[rank]
    sl = slice(lo, hi)
    topk = BehaviorTopK(*(t[sl] for t in (case.topk.token_ids, case.topk.token_logprobs, case.topk.topk_ids,
                                           case.topk.topk_logprobs)))
    z = case.logits[sl].detach().clone().requires_grad_(True)
    normalizer = loss_normalizer(loss_mask[sl], seq_ids[sl], config.aggregation, group=group)
    out = policy_loss(z, topk, A[sl], loss_mask[sl], config,
                      temperature=case.temperature, normalizer=normalizer, sequence_ids=seq_ids[sl])
    out.loss.backward()
    return out.loss.detach(), z.grad, out.metrics.reduce(group)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_data_parallel_aggregation_matches_one_big_batch(dist_pools, aggregation):
    T = 48
    case = make_case(T, 30, 4, dtype=torch.float64, noise=1.0)
    A = torch.randn(T, dtype=torch.float64)
    loss_mask = (torch.rand(T) > 0.3).float()
    seq_ids = torch.tensor([0] * 5 + [1] * 11 + [2] * 16 + [3] * 9 + [4] * 7)  # uneven lengths
    config = ObjectiveConfig(aggregation=aggregation)
    bounds = [(0, 16), (16, T)]  # rank 0 holds 2 sequences (16 tokens), rank 1 holds 3 (32 tokens)
    results = dist_pools(2).run(rank_dp_loss, shared=(case, A, loss_mask, seq_ids, config, bounds))
    z = case.logits.detach().clone().requires_grad_(True)
    big = policy_loss(z, case.topk, A, loss_mask, config,
                      temperature=case.temperature, normalizer=loss_normalizer(loss_mask, seq_ids, aggregation),
                      sequence_ids=seq_ids)
    big.loss.backward()
    torch.testing.assert_close(results[0][0] + results[1][0], big.loss.detach(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(torch.cat([results[0][1], results[1][1]]), z.grad, atol=1e-12, rtol=1e-10)
    # diagnostics reduced over DP equal the big batch's
    single = big.metrics.reduce()
    for r in results:
        assert r[2].keys() == single.keys()
        for name, v in single.items():
            assert r[2][name] == pytest.approx(v, rel=1e-10, abs=1e-12), name


def test_mismatch_corrections():
    T = 6
    case = make_case(T, 20, 3, dtype=torch.float64)
    A = torch.ones(T, dtype=torch.float64)
    lm = case.topk.token_logprobs.double()
    log_k = torch.tensor([-2.0, -0.5, 0.0, 0.5, 1.0, 2.0], dtype=torch.float64)  # log(pi_old / mu)
    old = lm + log_k
    k = log_k.exp()
    expect = {
        "tis": k.clamp(max=2.0),
        "mis": torch.where(k <= 2.0, k, 0.0),
        "icepop": torch.where((k >= 0.5) & (k <= 5.0), k, 0.0),
    }
    for correction, w in expect.items():
        config = ObjectiveConfig(mask="none", correction=correction, correction_cap=2.0)
        z = case.logits.detach().clone().requires_grad_(True)
        out = policy_loss(z, case.topk, A, torch.ones(T), config,
                          temperature=case.temperature, normalizer=1.0, old_logprobs=old)
        rho = (out.stats.logprobs.detach() - old).exp().clamp(max=5.0)
        torch.testing.assert_close(out.per_token_loss, -w * rho * out.stats.logprobs.detach())
    with pytest.raises(ValueError, match="old_logprobs: required"):
        policy_loss(case.logits, case.topk, A, torch.ones(T), ObjectiveConfig(correction="tis"),
                    temperature=case.temperature, normalizer=1.0)
    with pytest.raises(ValueError, match="ref_logprobs: required by objective.kl_coef = 0.1"):
        policy_loss(case.logits, case.topk, A, torch.ones(T), ObjectiveConfig(kl_coef=0.1),
                    temperature=case.temperature, normalizer=1.0)


def _expected_sequence_weights(config, log_k, on, seq_ids):
    """Per token: the correction weight and whether the sequence stays, by a loop over sequences (float64)."""
    w, keep = torch.ones_like(log_k), torch.ones_like(on)
    for s in seq_ids.unique():
        at = seq_ids == s
        lk = log_k[at & on]
        n = max(len(lk), 1)
        K = {"token": None, "sequence": lk.sum().exp(), "geometric": (lk.sum() / n).exp()}[config.correction_level]
        for t in at.nonzero().flatten():
            k = log_k[t].exp() if K is None else K
            w[t] = {"tis": min(k, config.correction_cap), "mis": k if k <= config.correction_cap else 0.0,
                    "none": 1.0}[config.correction]
        if (config.rejection == "k1" and abs(float(lk.sum()) / n) > config.rejection_threshold) or \
                (config.rejection == "k3" and float((lk.exp() - 1 - lk).sum()) / n > config.rejection_threshold) or \
                (config.veto_threshold is not None and bool((lk.exp() < config.veto_threshold).any())):
            keep[at] = False
    return w, keep


def _sequence_case(T=24):
    """Four sequences of 6 tokens (about 1 in 5 outside the loss), log(pi_old / mu) ~ N(0, 0.6^2) per token."""
    g = torch.Generator().manual_seed(9)
    case = make_case(T, 20, 3, dtype=torch.float64, seed=4)
    A = torch.randn(T, dtype=torch.float64, generator=g)
    on = torch.rand(T, generator=g) > 0.2
    return case, A, on, torch.arange(T) // 6, 0.6 * torch.randn(T, dtype=torch.float64, generator=g)


@pytest.mark.parametrize("kwargs", SEQUENCE_CONFIGS, ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_sequence_level_corrections_rejection_and_veto(kwargs):
    """The correction at the sequence's product or geometric mean of k = pi_old / mu, the k1 / k3 rejection and the
    token veto, against a loop over sequences; the loss tokens of a sequence are its only ones that count."""
    case, A, on, seq_ids, log_k = _sequence_case()
    old = case.topk.token_logprobs.double() + log_k
    config = ObjectiveConfig(mask="none", **kwargs)
    out = policy_loss(case.logits.detach().clone().requires_grad_(True), case.topk, A, on.double(), config,
                      temperature=case.temperature, normalizer=1.0, sequence_ids=seq_ids, old_logprobs=old)
    w, keep = _expected_sequence_weights(config, log_k, on, seq_ids)
    assert keep.any() and (~keep).any() if config.rejects else keep.all()
    logp = out.stats.logprobs.detach()
    base = old if config.correction != "none" else case.topk.token_logprobs.double()
    rho = (logp - base).exp().clamp(max=5.0)
    torch.testing.assert_close(out.per_token_loss, -(w * keep * on) * rho * A * logp)
    m = out.metrics.reduce(None)
    dropped = m.get("correction/rejected_frac", 0.0) + m.get("correction/vetoed_frac", 0.0)  # logged when asked for
    assert ("correction/rejected_frac" in m) == (config.rejection != "none")
    assert ("correction/vetoed_frac" in m) == (config.veto_threshold is not None)
    assert dropped >= (~keep[on]).double().mean().item() - 1e-12
    # a dropped sequence leaves the KL and entropy terms too (the review's regression)
    with_terms = ObjectiveConfig(mask="none", kl_coef=0.1, entropy_coef=0.1, **kwargs)
    out = policy_loss(case.logits, case.topk, A, on.double(), with_terms, temperature=case.temperature,
                      normalizer=1.0, sequence_ids=seq_ids, old_logprobs=old, ref_logprobs=torch.zeros(len(A)))
    assert (out.per_token_loss[~keep] == 0).all() and (out.per_token_loss[keep & on] != 0).all()


def rank_split_sequences(group, case, A, on, seq_ids, old, config):
    """This rank's half of every sequence (as context parallelism cuts them), the loss over the sequence group."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    mine = (torch.arange(len(seq_ids)) % 6 < 3) == (rank == 0)
    beh = case.topk
    topk = BehaviorTopK(beh.token_ids[mine], beh.token_logprobs[mine], beh.topk_ids[mine], beh.topk_logprobs[mine])
    out = policy_loss(case.logits[mine], topk, A[mine], on[mine].double(), config, temperature=case.temperature,
                      normalizer=1.0, sequence_ids=seq_ids[mine], old_logprobs=old[mine], sequence_group=group,
                      num_sequences=int(seq_ids.max()) + 1)
    return mine, out.per_token_loss


def test_sequence_corrections_over_split_sequences_equal_whole_ones(dist_pools):
    """Under context parallelism a sequence's tokens sit on several ranks: summed over the sequence group, every
    token's loss is what it is with the whole sequence in one call."""
    case, A, on, seq_ids, log_k = _sequence_case()
    old = case.topk.token_logprobs.double() + log_k
    config = ObjectiveConfig(mask="none", correction="tis", correction_level="geometric", rejection="k3",
                             rejection_threshold=0.05)
    whole = policy_loss(case.logits, case.topk, A, on.double(), config, temperature=case.temperature,
                        normalizer=1.0, sequence_ids=seq_ids, old_logprobs=old).per_token_loss
    for mine, part in dist_pools(2).run(rank_split_sequences, shared=(case, A, on, seq_ids, old, config)):
        torch.testing.assert_close(part, whole[mine], atol=1e-12, rtol=1e-10)


def test_policy_loss_rejects_bad_inputs():
    case = make_case(5, 20, 3)
    with pytest.raises(ValueError, match=r"advantages: expected shape \[5\]"):
        policy_loss(case.logits, case.topk, torch.ones(4), torch.ones(5), ObjectiveConfig(),
                    temperature=case.temperature, normalizer=1.0)
    with pytest.raises(ValueError, match="sequence_ids: required"):
        policy_loss(case.logits, case.topk, torch.ones(5), torch.ones(5),
                    ObjectiveConfig(aggregation="seq_mean_token_mean"), temperature=case.temperature, normalizer=1.0)
    with pytest.raises(ValueError, match=r"sequence_ids: expected shape \[5\]"):
        policy_loss(case.logits, case.topk, torch.ones(5), torch.ones(5),
                    ObjectiveConfig(aggregation="seq_mean_token_mean"),
                    temperature=case.temperature, normalizer=1.0, sequence_ids=torch.zeros(4))
    # values are not read per micro-batch: rewards are checked once per step, where advantages are made
    with pytest.raises(ValueError, match="rewards: NaN"):
        grpo_advantages(torch.tensor([float("nan"), 1.0]), 2)


# ---------------------------------------------------------------------------------------------- config


def test_config_defaults_and_errors():
    c = ObjectiveConfig()
    assert (c.mask, c.divergence, c.top_k, c.delta, c.ratio_cap, c.tail) == ("pdm", "topk_kl", 20, 0.15, 5.0,
                                                                              "aggregated")
    assert ObjectiveConfig(mask="dppo", divergence="binary_kl").delta == 0.05
    assert ObjectiveConfig(divergence="kl").needs_behavior_logits
    bad = [
        ({"mask": "clip"}, r"objective.mask: 'clip' is not one of ppo, dppo, pdm, none"),
        ({"divergence": "js"}, "objective.divergence: 'js'"),
        ({"delta": 0.0}, r"objective.delta: 0.0 must be > 0.0"),
        ({"delta": "big"}, "objective.delta: expected a number, got 'big'"),
        ({"eps_low": 1.5}, r"objective.eps_low: 1.5 must be <= 1.0"),
        ({"ratio_cap": 0.5}, r"objective.ratio_cap: 0.5 must be >= 1.0"),
        ({"top_k": 0}, r"objective.top_k: expected an integer >= 1, got 0"),
        ({"tail": "flat"}, "objective.tail: 'flat'"),
        ({"aggregation": "mean"}, "objective.aggregation: 'mean'"),
        ({"icepop_low": 2.0, "icepop_high": 1.0}, r"objective.icepop_high: 1.0 must be > 2.0"),
        ({"kl_type": "k4"}, r"objective.kl_type: 'k4' is not one of k1, abs, k2, k3, low_var_kl"),
        ({"correction_level": "sequence"}, r"objective.correction_level: 'sequence' weighs a correction, and "
                                           r"objective.correction is 'none'"),
        ({"rejection": "k2"}, r"objective.rejection: 'k2' is not one of none, k1, k3"),
        ({"rejection": "k1", "rejection_threshold": 0}, r"objective.rejection_threshold: 0 must be > 0.0"),
        ({"veto_threshold": 1.5}, r"objective.veto_threshold: 1.5 must be < 1.0"),
        ({"kl_coef": -0.1}, r"objective.kl_coef: -0.1 must be >= 0.0"),
        ({"kl_coef": float("inf")}, r"objective.kl_coef: expected a finite number, got inf"),
        ({"entropy_coef": "0.01x"}, r"objective.entropy_coef: expected a finite number, got '0.01x'"),
        ({"kl_unbiased": "yes"}, r"objective.kl_unbiased: expected true or false, got 'yes'"),
    ]
    assert ObjectiveConfig(kl_coef=0.01).needs_reference and not ObjectiveConfig().needs_reference
    for kwargs, msg in bad:
        with pytest.raises(ValueError, match=msg):
            ObjectiveConfig(**kwargs)
    with pytest.raises(ValueError, match="objective: unknown key.s. detla"):
        ObjectiveConfig.from_dict({"detla": 0.1})
    with pytest.raises(ValueError, match="objective: unknown key.s. temperature"):  # rollout.temperature's alone
        ObjectiveConfig.from_dict({"temperature": 0.7})
    assert ObjectiveConfig.from_dict({"mask": "dppo"}).mask == "dppo"


# ---------------------------------------------------------------------------------------------- advantages


def test_group_advantages():
    R = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    g = grpo_advantages(R, 4)
    first = torch.tensor([1.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(g[:4], (first - 0.5) / (first.std() + 1e-6))
    torch.testing.assert_close(g[4:], torch.zeros(4))  # identical rewards: no signal
    torch.testing.assert_close(grpo_advantages(R, 4, normalize_std=False)[:4], first - 0.5)
    loo = rloo_advantages(R, 4)
    for i in range(4):
        others = torch.cat([first[:i], first[i + 1:]])
        assert float(loo[i]) == pytest.approx(float(first[i] - others.mean()))
    torch.testing.assert_close(grpo_advantages(torch.tensor([3.0, 4.0]), 1), torch.zeros(2))
    torch.testing.assert_close(grpo_advantages(R, 4, eps=0.0)[4:], torch.zeros(4))  # was 0 / 0 = NaN
    with pytest.raises(ValueError, match="group_size: 3 must be >= 1 and divide the 8 rewards"):
        grpo_advantages(R, 3)
    with pytest.raises(ValueError, match="rewards: NaN"):
        grpo_advantages(torch.tensor([float("nan"), 1.0]), 2)


def test_a_group_of_equal_rewards_has_zero_advantage_exactly():
    """Seven equal float64 rewards whose mean is an ulp off: exactly 0 (the regression: with eps = 0, an ulp over
    a 1e-17 std gave O(1) advantages); every other group bitwise as the formula gives it."""
    equal = torch.full((7,), 0.7850636949329074, dtype=torch.float64)
    for kw in ({"eps": 0.0}, {}, {"normalize_std": False}):
        assert grpo_advantages(equal, 7, **kw).tolist() == [0.0] * 7, kw
    g = torch.Generator().manual_seed(0)
    R = torch.cat([torch.rand(8, generator=g, dtype=torch.float64), torch.ones(4, dtype=torch.float64),
                   torch.randint(0, 2, (12,), generator=g).double()])
    groups = R.view(-1, 4)
    formula = (groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)
    out = grpo_advantages(R, 4).view(-1, 4)
    differ = (groups != groups[:, :1]).any(-1)
    assert torch.equal(out[differ], formula[differ]) and not out[~differ].any()


def test_advantages_broadcast_over_responses_of_different_lengths():
    adv = torch.tensor([1.0, -2.0, 0.5])
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1]])
    out = broadcast_to_tokens(adv, mask)
    assert out.tolist() == [[0, 1, 1, 0], [0, 0, -2, -2], [0.5, 0.5, 0.5, 0.5]]
    with pytest.raises(ValueError, match="response_mask"):
        broadcast_to_tokens(adv, mask[:2])


# ---------------------------------------------------------------------------------------------- diagnostics, analysis


def test_metrics_fractions_and_max():
    m = Metrics()
    m.add_fraction("f", torch.tensor([True, False, True, True]), torch.tensor([1, 1, 1, 0]))
    m.add_max("mx", torch.tensor([1.0, 5.0, 2.0]), torch.tensor([True, False, True]))
    other = Metrics()
    other.add_fraction("f", torch.tensor([False]), torch.tensor([1]))
    other.add_max("mx", torch.tensor([3.0]))
    out = m.merge(other).reduce()
    assert out == {"f": 0.5, "mx": 3.0}


def _quantile_on_rank(group, values, where):
    m = Metrics()
    m.add_quantile("q", values, where, q=0.99)
    return m.reduce(group)["q_p99"]


@pytest.mark.parametrize("world", [1, 3])
def test_quantile_metric_matches_torch_quantile_across_ranks(dist_pools, world):
    # |log r|-like values over eight decades, split unevenly over the data-parallel ranks
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    values = torch.exp(torch.empty(5000, dtype=torch.float64).uniform_(-14, 3, generator=g))
    where = torch.rand(5000, generator=g) < 0.8
    cuts = sorted(torch.randint(1, 5000, (world - 1,), generator=g).tolist())
    bounds = list(zip([0, *cuts], [*cuts, 5000], strict=True))
    args = [(values[a:b], where[a:b]) for a, b in bounds]
    got = _quantile_on_rank(None, *args[0]) if world == 1 else dist_pools(world).run(_quantile_on_rank, args)
    ref = torch.quantile(values[where], 0.99, interpolation="higher").item()
    for q in [got] if world == 1 else got:  # bins span a factor 1.037: the midpoint is within 2% of the value
        assert q == pytest.approx(ref, rel=0.02)


def test_quantile_metric_edges_and_errors():
    m = Metrics()
    m.add_quantile("z", torch.zeros(10), q=0.5)
    m.add_quantile("big", torch.full((4,), 1e3), q=0.99)
    m.add_quantile("none", torch.ones(3), torch.zeros(3, dtype=torch.bool), q=0.99)
    m.add_quantile("masked_neg", torch.tensor([-1.0, 2.0]), torch.tensor([False, True]), q=0.5)
    out = m.reduce()
    assert out["z_p50"] == 0.0 and out["big_p99"] == pytest.approx(100.0) and math.isnan(out["none_p99"])
    assert out["masked_neg_p50"] == pytest.approx(2.0, rel=0.02)
    m.add_quantile("neg", torch.tensor([-1.0, 3.0]), q=0.5)  # no host sync here: reduce raises
    with pytest.raises(ValueError, match="neg: quantiles are of non-negative values, got 1 negative"):
        m.reduce()


def test_diagnostics_split_the_masked_tokens():
    pi = torch.tensor([[0.9, 0.055, 0.03, 0.015]] * 4, dtype=torch.float64)
    mu = torch.tensor([[0.6, 0.05, 0.2, 0.15]] * 4, dtype=torch.float64)
    behavior = _full_support_behavior(mu, torch.tensor([1, 1, 0, 0]))
    A = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    out = policy_loss(pi.log(), behavior, A, torch.ones(4), ObjectiveConfig(mask="dppo"),
                      temperature=1.0, normalizer=4.0)
    d = out.metrics.reduce()
    # all four are outside (KL = 0.477 > 0.15); ratio direction: token 1 has r > 1, token 0 has r < 1
    assert d["mask/outside_frac"] == 1.0
    assert d["mask/masked_frac"] == 0.5  # A > 0 on token 1 and A < 0 on token 0 push r away from 1
    assert d["mask/proximity_only_frac"] == 0.5
    assert d["mask/direction_only_frac"] == 0.0
    assert d["divergence/max"] == pytest.approx(float(out.stats.divergence.max()))
    # token 1 disagrees (ratio up, PDM down); on token 0 (pi_0 = 0.9 > mu_0 = 0.6, r > 1) both agree
    assert d["mask/direction_disagree_frac"] == 0.5


def test_alignment_rates_on_a_constructed_case():
    # six tokens outside the region; the two rules disagree on four of them
    d_before = torch.tensor([0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.01])
    d_after = torch.tensor([0.2, 0.4, 0.4, 0.2, 0.5, 0.1, 0.5])
    log_ratio = torch.tensor([0.1, 0.1, -0.1, -0.1, 0.1, 0.1, 0.1])
    ddot = torch.tensor([-1.0, -1.0, 1.0, 1.0, 1.0, 1.0, -1.0])
    A = torch.ones(7)
    out = alignment_rates(d_before, d_after, log_ratio, ddot, A, delta=0.15)
    assert out["outside"] == 6 and out["disagree"] == 4
    # ratio rule keeps tokens 2, 3 (r < 1): 2 increased, 3 decreased; PDM keeps 0, 1: 0 decreased, 1 increased
    assert out["ratio_kept"] == 2 and out["pdm_kept"] == 2
    assert out["ratio_unsafe_keep_rate"] == 0.5 and out["ratio_corrective_keep_rate"] == 0.5
    assert out["pdm_unsafe_keep_rate"] == 0.5 and out["pdm_corrective_keep_rate"] == 0.5
    out = alignment_rates(d_before, d_after, log_ratio, ddot, A, delta=0.15, where=torch.tensor([1, 0, 1, 1, 1, 1, 1]))
    assert out["pdm_kept"] == 1 and out["pdm_unsafe_keep_rate"] == 0.0 and out["pdm_corrective_keep_rate"] == 1.0


@pytest.mark.e2e
def test_drop_in_example_runs_over_two_tp_processes():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "examples" / "drop_in_policy_loss.py")], capture_output=True,
                         text=True, check=True, cwd=root, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.stdout.startswith("loss ") and "mask/masked_frac" in out.stdout
