"""Finite math at the edges: every statistic and the loss are finite for finite (or -inf) logits and a valid
BehaviorTopK, and agree with the float64 reference (tests/reference.py) in float32 and bf16, at TP 1 and 2.

The first tests are regressions, each a case that gave inf or NaN before: a top-K KL whose pi tail is 0 while mu's
1 - sum keeps a rounding residue, SGLang's -3.4e38 for an entry that underflowed, a binary KL with pi_k = 1 in
float32, an engine log-prob of +1e-6, and -inf logits (masked vocabulary entries). Then hypothesis properties
(derandomized, bounded) over random shapes, temperatures, scales, masks and engine underflow markers.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pdm.objectives import ObjectiveConfig, policy_loss
from megatron_pdm.vocab_parallel import (
    EXACT_KINDS,
    TAILS,
    TOPK_KINDS,
    BehaviorTopK,
    entropy,
    policy_statistics,
)
from tests.reference import (
    Case,
    assert_ddot_close,
    ref_divergence_and_change,
    ref_entropy,
    ref_logpi,
    tv_sign_slack,
)

F32_MIN = torch.finfo(torch.float32).min  # SGLang reports an underflowed top-K entry as this log-prob
COMBOS = [(kind, tail) for kind in TOPK_KINDS for tail in (TAILS if kind == "topk_kl" else ("aggregated",))]
ALL_COMBOS = COMBOS + [(kind, "aggregated") for kind in EXACT_KINDS]


def _engine_view(log_mu: torch.Tensor, k: torch.Tensor, K: int, *, underflow=F32_MIN) -> BehaviorTopK:
    """What an engine reports from float64 log mu [T, V]: float32 log-probs of the sampled token and the top-K, an
    entry whose probability is 0 in float32 reported as `underflow` (SGLang: finfo(float32).min)."""
    top_lp, top_ids = log_mu.topk(K, dim=-1)
    top = top_lp.float()
    top = torch.where(top.exp() == 0, underflow, top)
    return BehaviorTopK(k, log_mu.gather(1, k[:, None]).squeeze(-1).float(), top_ids, top)


def _all_stats(z, case: Case, group=None):
    out = {}
    for kind, tail in ALL_COMBOS:
        beh = case.exact if kind in EXACT_KINDS else case.topk
        out[kind, tail] = policy_statistics(z, beh, kind, tail=tail, group=group, temperature=case.temperature)
    return out


def _assert_finite(stats, msg=""):
    for key, s in stats.items():
        for name, t in s._asdict().items():
            assert torch.isfinite(t).all(), f"{msg} {key} {name}: {t}"


# ---------------------------------------------------------------------------------------------- regressions


def test_topk_kl_is_finite_when_the_support_covers_the_vocabulary():
    # K = V (and K = V - 1 with the sampled token outside the top-K): no tail, but mu's 1 - sum of float32
    # probabilities keeps a ~1e-8 residue; pi's tail is exactly 0. Before: D = +inf on half the rows.
    T, V = 16, 12
    g = torch.Generator().manual_seed(0)
    z = 3 * torch.randn(T, V, generator=g)
    log_mu = torch.log_softmax(z.double() + 0.3 * torch.randn(T, V, generator=g, dtype=torch.float64), -1)
    full = _engine_view(log_mu, log_mu.argmax(-1), V)
    outside = _engine_view(log_mu, log_mu.argmin(-1), V - 1)  # the least likely token sampled, outside the top-K
    for beh in (full, outside):
        case = Case(z, log_mu, beh, 1.0)
        for tail in TAILS:
            s = policy_statistics(z, beh, "topk_kl", tail=tail)
            d_ref, dd_ref = ref_divergence_and_change(case, "topk_kl", tail)
            assert torch.isfinite(s.divergence).all() and torch.isfinite(s.predicted_change).all()
            torch.testing.assert_close(s.divergence.double(), d_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(s.predicted_change.double(), dd_ref, atol=1e-5, rtol=1e-5)


def test_topk_kl_is_finite_when_pi_tail_underflows_in_float32():
    # V = 32768, float32, temperature 0.5: a head of K tokens and a tail 60 logits below, so pi's tail (~1e-48)
    # underflows to 0 while mu's 1 - sum keeps a rounding residue. Before: D = +inf on 3 rows of 8.
    T, V, K = 8, 32768, 20
    g = torch.Generator().manual_seed(0)
    z = -60 + torch.randn(T, V, generator=g)
    z[:, :K] = torch.randn(T, K, generator=g)
    b = z + 0.1 * torch.randn(T, V, generator=g)
    log_mu = torch.log_softmax(b / 0.5, -1)  # in float32, as an engine computes it
    beh = _engine_view(log_mu, log_mu.topk(K, -1).indices[:, 3], K)
    case = Case(z, b, beh, 0.5)
    for kind, tail in COMBOS:
        s = policy_statistics(z, beh, kind, tail=tail, temperature=0.5)
        d_ref, dd_ref = ref_divergence_and_change(case, kind, tail)
        assert torch.isfinite(s.divergence).all() and torch.isfinite(s.predicted_change).all(), (kind, tail)
        # mu_tail is a rounding residue (~1e-7, of either sign) and log pi_tail ~ -112 underflows to log(tiny) = -87:
        # their product, ~1e-5, is all that float32 and the float64 reference may differ by
        torch.testing.assert_close(s.divergence.double(), d_ref, atol=1e-5, rtol=1e-4, msg=f"{kind} {tail}")
        torch.testing.assert_close(s.predicted_change.double(), dd_ref, atol=1e-5, rtol=1e-4, msg=f"{kind} {tail}")


@pytest.mark.parametrize("underflow", [F32_MIN, float("-inf")])
def test_an_underflowed_engine_log_prob_is_probability_zero(underflow):
    # SGLang clamps log(0) to finfo(float32).min: top-K entries of a peaked mu. Before: topk_kl's Ddot and topk_tv's
    # D were NaN (0 * expm1(3.4e38)), and -inf was rejected by validation.
    T, V, K = 6, 40, 20
    g = torch.Generator().manual_seed(1)
    b = torch.randn(T, V, generator=g, dtype=torch.float64)
    b[:, : K // 2] += 120.0  # half the top-K hold all the mass: the other half underflow in float32
    log_mu = torch.log_softmax(b, -1)
    z = (b + torch.randn(T, V, generator=g, dtype=torch.float64)).float() / 10  # pi far from mu, nothing underflows
    k = log_mu.argmax(-1)
    beh = _engine_view(log_mu, k, K, underflow=underflow).validate(V)
    assert (beh.topk_logprobs == underflow).sum() == T * K // 2
    case = Case(z, b, beh, 1.0)
    for kind, tail in COMBOS:
        s = policy_statistics(z, beh, kind, tail=tail)
        d_ref, dd_ref = ref_divergence_and_change(case, kind, tail)
        torch.testing.assert_close(s.divergence.double(), d_ref, atol=1e-5, rtol=1e-5, msg=f"{kind} {tail}")
        torch.testing.assert_close(s.predicted_change.double(), dd_ref, atol=1e-5, rtol=1e-5, msg=f"{kind} {tail}")
    # the sampled token's own log mu(k) underflowed too: the ratio is infinite, the loss and its gradient finite
    lm = beh.token_logprobs.clone()
    lm[:2] = underflow
    beh = BehaviorTopK(k, lm, beh.topk_ids, beh.topk_logprobs).validate(V)
    A = torch.tensor([1.0, 0.0, -1.0, 1.0, 0.0, -1.0])
    for config in (ObjectiveConfig(loss="ppo"), ObjectiveConfig(mask="ppo", loss="ppo"), ObjectiveConfig()):
        leaf = z.clone().requires_grad_(True)
        out = policy_loss(leaf, beh, A, torch.ones(T), config, temperature=1.0, normalizer=float(T))
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(leaf.grad).all(), config
        assert out.metrics.reduce()["mismatch/kl_k3"] == float("inf")  # an infinite mismatch, not NaN


def test_binary_kl_is_finite_when_pi_k_rounds_to_one_in_float32():
    # every other token 110 logits below k: 1 - pi_k ~ 8e-47 underflows in float32. Before: D = +inf in float32,
    # 0.0174 (below delta = 0.05) in float64.
    z = torch.full((1, 50), -110.0)
    z[0, 0] = 0.0
    lm = torch.tensor([-1.8e-4])
    beh = BehaviorTopK(torch.tensor([0]), lm, torch.tensor([[0]]), lm[:, None])
    case = Case(z, z.double(), beh, 1.0)
    s32, s64 = policy_statistics(z, beh, "binary_kl"), policy_statistics(z.double(), beh, "binary_kl")
    d_ref, dd_ref = ref_divergence_and_change(case, "binary_kl")
    torch.testing.assert_close(s64.divergence, d_ref, rtol=1e-9, atol=0)
    assert torch.isfinite(s32.divergence).all() and torch.isfinite(s32.predicted_change).all()
    # 1 - pi_k is clamped at finfo(float32).tiny: a lower bound, on the same side of delta
    assert 0.0 < float(s32.divergence) <= float(d_ref) < 0.05
    assert torch.equal(torch.sign(s32.predicted_change).double(), torch.sign(dd_ref))


def test_a_positive_engine_log_prob_counts_as_zero():
    # validation tolerates rounding up to 1e-3 above 0; before: binary KL = NaN (xlogy of 1 - mu_k < 0)
    g = torch.Generator().manual_seed(2)
    z = torch.randn(3, 30, generator=g)
    lm = torch.tensor([1e-6, 1e-4, 0.0])
    beh = BehaviorTopK(torch.tensor([0, 1, 2]), lm, torch.tensor([[0], [1], [2]]), lm[:, None]).validate(30)
    at_zero = BehaviorTopK(beh.token_ids, torch.zeros(3), beh.topk_ids, torch.zeros(3, 1))
    for kind, tail in COMBOS:
        s, s0 = policy_statistics(z, beh, kind, tail=tail), policy_statistics(z, at_zero, kind, tail=tail)
        for a, b in zip(s, s0, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"{kind} {tail}")


def _masked_case(T, V, masked, *, seed, dtype=torch.float32, temperature=0.9, K=4):
    """Logits with the columns `masked` at -inf in both pi's and mu's logits, and the same case on the vocabulary
    without them (ids remapped): the statistics must be those of the distributions over the finite entries."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.ones(V, dtype=torch.bool)
    keep[masked] = False
    z = 2 * torch.randn(T, V, generator=g, dtype=torch.float64)
    b = z + 0.5 * torch.randn(T, V, generator=g, dtype=torch.float64)
    z[:, ~keep], b[:, ~keep] = float("-inf"), float("-inf")
    z = z.to(dtype)
    log_mu = torch.log_softmax(b / temperature, -1)
    k = torch.multinomial(log_mu.exp(), 1, generator=g).squeeze(-1)
    beh = _engine_view(log_mu, k, K)
    new_id = torch.cumsum(keep.long(), 0) - 1  # id in the vocabulary of finite entries
    sub = BehaviorTopK(new_id[beh.token_ids], beh.token_logprobs, new_id[beh.topk_ids], beh.topk_logprobs)
    return Case(z, b, beh, temperature), Case(z[:, keep], b[:, keep], sub, temperature)


def test_minus_inf_logits_are_probability_zero_torch_path():
    # a caller masks vocabulary entries with -inf (in both pi's and mu's logits). Before: entropy, exact KL and
    # reverse KL were NaN (0 * -inf, -inf - -inf).
    case, sub = _masked_case(7, 40, [0, 5, 6, 7, 39], seed=3)
    stats = _all_stats(case.logits, case)
    _assert_finite(stats)
    torch.testing.assert_close(entropy(case.logits, temperature=case.temperature).double(),
                               ref_entropy(sub.logits, sub.temperature), atol=1e-5,
                               rtol=1e-5)
    for (kind, tail), s in stats.items():
        # the uniform tail divides by V - |S|, and V counts the masked entries: that one against the full vocabulary
        d_ref, dd_ref = ref_divergence_and_change(case if tail == "uniform" else sub, kind, tail)
        torch.testing.assert_close(s.divergence.double(), d_ref, atol=1e-5, rtol=1e-5, msg=f"{kind} {tail}")
        slack = tv_sign_slack(sub.logits, sub.topk, kind, temperature=sub.temperature,
                              behavior_logits=sub.behavior_logits)
        assert_ddot_close(s.predicted_change, dd_ref, slack, atol=1e-5, rtol=1e-5, msg=f"{kind} {tail}")
        torch.testing.assert_close(s.entropy.double(), ref_entropy(sub.logits, sub.temperature), atol=1e-5, rtol=1e-5)


def test_minus_inf_logits_on_a_whole_shard_at_tp2(dist_pools):
    # rank 1's whole shard is -inf (a padded vocabulary tail): its local log-sum-exp is -inf, not NaN
    V = 2 * 24
    case, sub = _masked_case(5, V, list(range(24, V)), seed=4, temperature=0.5)
    case.logits, sub.logits = case.logits - 60, sub.logits - 60  # log Z ~ -120: e^(m - log Z) must not overflow
    results = dist_pools(2).run(rank_case_stats, shared=(case,))
    single = {key: tuple(s) for key, s in _all_stats(sub.logits, sub).items()}
    for r in results:
        for key, values in r.items():
            if key[1] == "uniform":  # divides by V - |S|, and V counts the masked entries
                continue
            for name, a, b in zip(("logprobs", "behavior_logprobs", "entropy", "divergence", "predicted_change"),
                                  values, single[key], strict=True):
                assert torch.isfinite(a).all(), (key, name)
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{key} {name}")


# ---------------------------------------------------------------------------------------------- properties


def _random_case(T, V, K, *, scale, temperature, noise, seed, dtype, n_masked=0, underflow=F32_MIN,
                 outside=True):
    """z = scale N(0, 1), mu's logits z + noise N(0, 1) in float64, n_masked columns per row at -inf in both (never
    all but K); the engine's view in float32 with `underflow` for entries whose probability is 0 in float32; the
    sampled token outside the top-K on half the rows when `outside` and such a token has probability > 0."""
    g = torch.Generator().manual_seed(seed)
    z = scale * torch.randn(T, V, generator=g, dtype=torch.float64)
    b = z + noise * torch.randn(T, V, generator=g, dtype=torch.float64)
    if n_masked:
        cols = torch.rand(T, V, generator=g).argsort(-1)[:, :n_masked]
        z.scatter_(1, cols, float("-inf"))
        b.scatter_(1, cols, float("-inf"))
    log_mu = torch.log_softmax(b / temperature, -1)
    mu = log_mu.exp()
    rest = mu.scatter(1, log_mu.topk(K, -1).indices, 0.0)
    use_rest = outside & (torch.rand(T, generator=g) < 0.5) & (rest.sum(-1) > 0)
    k = torch.multinomial(torch.where(use_rest[:, None], rest, mu), 1, generator=g).squeeze(-1)
    return Case(z.to(dtype), b, _engine_view(log_mu, k, K, underflow=underflow), temperature)


def rank_case_stats(group, case):
    import torch.distributed as dist

    rank, world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    z, topk, exact = case.shard(rank, world)
    return {key: tuple(s) for key, s in _all_stats(z, Case(z, exact.logits, topk, case.temperature), group).items()}


def _run(dist_pools, world, case):
    if world == 1:
        return [rank_case_stats(None, case)]
    return dist_pools(world).run(rank_case_stats, shared=(case,))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_property_agrees_with_the_float64_reference(dist_pools, world, dtype):
    @settings(max_examples=25, deadline=None, derandomize=True, database=None)
    @given(K=st.integers(1, 6), width=st.integers(4, 24), T=st.integers(1, 5), scale=st.floats(0.1, 4.0),
           temperature=st.sampled_from([0.5, 0.8, 1.0, 1.7]), noise=st.floats(0.0, 2.0),
           seed=st.integers(0, 2**31 - 1))
    def check(K, width, T, scale, temperature, noise, seed):
        V = width * world
        case = _random_case(T, V, min(K, V), scale=scale, temperature=temperature, noise=noise, seed=seed,
                            dtype=dtype)
        results = _run(dist_pools, world, case)
        lp_ref = ref_logpi(case.logits, temperature).gather(1, case.topk.token_ids[:, None]).squeeze(-1)
        for kind, tail in ALL_COMBOS:
            d_ref, dd_ref = ref_divergence_and_change(case, kind, tail)
            slack = tv_sign_slack(case.logits, case.topk, kind, temperature=temperature,
                                  behavior_logits=case.behavior_logits)
            for r in results:
                logp, _, ent, d, dd = r[kind, tail]
                msg = f"{kind} {tail} V={V} K={K} T={temperature} scale={scale} noise={noise} seed={seed}"
                for t in (logp, ent, d, dd):
                    assert torch.isfinite(t).all(), msg
                torch.testing.assert_close(d.double(), d_ref, atol=5e-5, rtol=1e-4, msg=msg)
                assert_ddot_close(dd, dd_ref, slack, atol=5e-5, rtol=1e-4, msg=msg)
                torch.testing.assert_close(logp.double(), lp_ref, atol=5e-5, rtol=1e-5, msg=msg)
                torch.testing.assert_close(ent.double(), ref_entropy(case.logits, temperature), atol=1e-4, rtol=1e-5,
                                           msg=msg)

    check()


def rank_edge_loss(group, case, A, configs):
    import torch.distributed as dist

    rank, world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    z, topk, exact = case.shard(rank, world)
    stats = _all_stats(z, Case(z, exact.logits, topk, case.temperature), group)
    bad = [f"{key} {name}" for key, s in stats.items() for name, t in s._asdict().items()
           if not torch.isfinite(t).all()]
    for config in configs:
        leaf = z.detach().clone().requires_grad_(True)
        beh = exact if config.divergence in EXACT_KINDS else topk
        out = policy_loss(leaf, beh, A, torch.ones(len(A)), config, temperature=1.0, normalizer=float(len(A)),
                          tp_group=group)
        out.loss.backward()
        if not (torch.isfinite(out.loss) and torch.isfinite(leaf.grad).all()):
            bad.append(f"loss {config}")
    return bad


EDGE_CONFIGS = (ObjectiveConfig(), ObjectiveConfig(mask="dppo", divergence="binary_kl", loss="ppo"),
                ObjectiveConfig(mask="pdm", divergence="reverse_kl", tail="proportional"),
                ObjectiveConfig(mask="ppo", loss="ppo", aggregation="seq_mean_token_sum"))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_property_everything_is_finite_at_the_edges(dist_pools, world, dtype):
    """Peaked and flat policies, low temperatures, -inf logits, underflowed engine entries (-3.4e38 or -inf):
    entropy, log-probs, D, Ddot of every kind, the loss and its gradient stay finite."""
    @settings(max_examples=20, deadline=None, derandomize=True, database=None)
    @given(K=st.integers(1, 8), width=st.integers(4, 20), T=st.integers(1, 5), scale=st.floats(0.0, 60.0),
           temperature=st.sampled_from([0.1, 0.5, 1.0, 2.0]), noise=st.floats(0.0, 5.0),
           masked=st.integers(0, 12), underflow=st.sampled_from([F32_MIN, float("-inf")]),
           seed=st.integers(0, 2**31 - 1))
    def check(K, width, T, scale, temperature, noise, masked, underflow, seed):
        V = width * world
        K = min(K, V)
        case = _random_case(T, V, K, scale=scale, temperature=temperature, noise=noise, seed=seed, dtype=dtype,
                            n_masked=min(masked, V - K), underflow=underflow)
        A = torch.linspace(-1.0, 1.0, T)  # with A = 0 on odd T
        if world == 1:
            bad = [rank_edge_loss(None, case, A, EDGE_CONFIGS)]
        else:
            bad = dist_pools(world).run(rank_edge_loss, shared=(case, A, EDGE_CONFIGS))
        assert not any(bad), (bad, dict(K=K, V=V, T=T, scale=scale, temperature=temperature, noise=noise,
                                        masked=masked, seed=seed))

    check()
