"""The vocab-parallel core against the float64 full-vocabulary reference, at TP = 1, 2 and 4 over gloo."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pdm.vocab_parallel import (
    EXACT_KINDS,
    KINDS,
    TAILS,
    BehaviorLogits,
    BehaviorTopK,
    divergence,
    entropy,
    kl_to_reference,
    policy_statistics,
    predicted_divergence_change,
    token_logprobs,
)
from tests.reference import (
    Case,
    assert_ddot_close,
    make_case,
    ref_divergence_and_change,
    ref_entropy,
    ref_logpi,
    ref_pidot,
    tv_sign_slack,
)

COMBOS = [(kind, tail) for kind in KINDS for tail in (TAILS if kind == "topk_kl" else ("aggregated",))]
TOL = {torch.float64: 1e-11, torch.float32: 2e-5, torch.bfloat16: 2e-5}


def _rank_group(group):
    import torch.distributed as dist

    return (None, 0, 1) if group is None else (group, dist.get_rank(group), dist.get_world_size(group))


def rank_all_stats(group, case: Case, chunk_size):
    """Every (kind, tail) on this rank's shard, plus the gradient of sum_t w_t log pi_t(k_t) w.r.t. the shard."""
    group, rank, world = _rank_group(group)
    z, topk, exact = case.shard(rank, world)
    out = {}
    for kind, tail in COMBOS:
        beh = exact if kind in EXACT_KINDS else topk
        s = policy_statistics(z, beh, kind, tail=tail, group=group, temperature=case.temperature, chunk_size=chunk_size)
        out[kind, tail] = (s.divergence, s.predicted_change)
    out["entropy"] = entropy(z, group=group, temperature=case.temperature, chunk_size=chunk_size)
    leaf = z.detach().clone().requires_grad_(True)
    lp = token_logprobs(leaf, topk.token_ids, group=group, temperature=case.temperature, chunk_size=chunk_size)
    w = torch.linspace(-1.0, 2.0, lp.shape[0], dtype=lp.dtype)
    (w * lp).sum().backward()
    out["logprobs"], out["grad"] = lp.detach(), leaf.grad
    return out


def _run(dist_pools, world, case, chunk_size):
    if world == 1:
        return [rank_all_stats(None, case, chunk_size)]
    return dist_pools(world).run(rank_all_stats, shared=(case, chunk_size))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_matches_reference_across_tp(dist_pools, world, dtype):
    # odd shard width, ragged last chunk, sampled token inside and outside the top-K, T != 1
    width, T, K = 37, 23, 6
    case = make_case(T, width * world, K, temperature=0.7, dtype=dtype)
    results = _run(dist_pools, world, case, chunk_size=5)
    _assert_matches_reference(case, results, dtype)


def _assert_matches_reference(case, results, dtype):
    """Every rank's `rank_all_stats` against the float64 reference; the shard gradients concatenated."""
    T = case.logits.shape[0]
    tol = TOL[dtype]
    in_top = (case.topk.topk_ids == case.topk.token_ids[:, None]).any(-1)
    assert in_top.any() and (~in_top).any()
    for kind, tail in COMBOS:
        d_ref, dd_ref = ref_divergence_and_change(case, kind, tail)
        slack = 0.0 if dtype == torch.float64 else tv_sign_slack(  # TV's sign(pi - mu) flips on float32 noise
            case.logits, case.topk, kind, temperature=case.temperature, behavior_logits=case.behavior_logits)
        for r in results:  # every rank holds the same per-token answer
            d, dd = r[kind, tail]
            torch.testing.assert_close(d.double(), d_ref, atol=tol, rtol=tol, msg=f"D {kind} {tail}")
            assert_ddot_close(dd, dd_ref, slack, atol=tol, rtol=tol, msg=f"Ddot {kind} {tail}")
    lp_ref = ref_logpi(case.logits, case.temperature)
    logp_ref = lp_ref.gather(1, case.topk.token_ids[:, None]).squeeze(-1)
    for r in results:
        torch.testing.assert_close(r["logprobs"].double(), logp_ref, atol=tol, rtol=tol)
        torch.testing.assert_close(r["entropy"].double(), ref_entropy(case.logits, case.temperature), atol=5 * tol,
                                   rtol=tol)

    # gradient of sum_t w_t log pi_t(k_t) against autograd of the reference, shard by shard
    z = case.logits.double().requires_grad_(True)
    w = torch.linspace(-1.0, 2.0, T, dtype=torch.float64)
    lp = torch.log_softmax(z / case.temperature, -1).gather(1, case.topk.token_ids[:, None]).squeeze(-1)
    (w * lp).sum().backward()
    grad = torch.cat([r["grad"] for r in results], dim=1)
    assert grad.dtype == case.logits.dtype
    gtol = 1e-2 if dtype == torch.bfloat16 else tol  # the gradient is returned in the logits dtype
    torch.testing.assert_close(grad.double(), z.grad, atol=gtol, rtol=gtol)


def rank_entropy_gradient(group, case: Case, chunk_size):
    """H and the gradient of sum_t (w_t log pi_t(k_t) + v_t H_t) w.r.t. this rank's shard, through
    `policy_statistics` (a top-K and an exact kind), and of sum_t v_t H_t through `entropy` on logits with -inf
    entries (masked vocabulary: 0 log 0 = 0)."""
    group, rank, world = _rank_group(group)
    z, topk, exact = case.shard(rank, world)
    T = z.shape[0]
    w = torch.linspace(-1.0, 2.0, T, dtype=torch.float64)
    v = torch.linspace(0.5, -1.5, T, dtype=torch.float64)
    out = {}
    for name, beh, kind in (("topk", topk, "topk_kl"), ("exact", exact, "kl")):
        leaf = z.detach().clone().requires_grad_(True)
        s = policy_statistics(leaf, beh, kind, group=group, temperature=case.temperature, chunk_size=chunk_size,
                              entropy_grad=True)
        (w.to(s.logprobs.dtype) * s.logprobs + v.to(s.entropy.dtype) * s.entropy).sum().backward()
        out[name] = (s.entropy.detach(), leaf.grad)
    leaf = _masked(z, rank).requires_grad_(True)
    H = entropy(leaf, group=group, temperature=case.temperature, chunk_size=chunk_size)
    (v.to(H.dtype) * H).sum().backward()
    out["masked"] = (H.detach(), leaf.grad)
    return out


def rank_kl_to_reference(group, case: Case, chunk_size):
    """KL(pi || pi_ref) and the gradient of sum_t v_t KL_t w.r.t. this rank's shard, pi_ref from the case's behavior
    logits; also with -inf at the same entries of both (masked vocabulary)."""
    group, rank, world = _rank_group(group)
    z, _, beh = case.shard(rank, world)
    v = torch.linspace(0.5, -1.5, z.shape[0], dtype=torch.float64)
    out = {}
    for name, zz, rr in (("plain", z, beh.logits), ("masked", _masked(z, rank), _masked(beh.logits, rank))):
        leaf = zz.detach().clone().requires_grad_(True)
        kl = kl_to_reference(leaf, rr, group=group, temperature=case.temperature, chunk_size=chunk_size)
        (v.to(kl.dtype) * kl).sum().backward()
        out[name] = (kl.detach(), leaf.grad)
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_exact_kl_to_reference_matches_autograd_across_tp(dist_pools, world, dtype):
    """KL(pi || pi_ref) = sum_i pi_i (log pi_i - log pi_ref_i) and dKL/dz_i = (pi_i / T)(log pi_i - log pi_ref_i - KL)
    per shard, against autograd on the gathered logits in float64 (the exact KL penalty, objective.kl_type exact)."""
    width, T, K = 37, 23, 6
    case = make_case(T, width * world, K, temperature=0.7, dtype=dtype, seed=12)
    results = [rank_kl_to_reference(None, case, 5)] if world == 1 else \
        dist_pools(world).run(rank_kl_to_reference, shared=(case, 5))
    tol = TOL[dtype]
    v = torch.linspace(0.5, -1.5, T, dtype=torch.float64)
    for name in ("plain", "masked"):
        shards = [case.shard(r, world) for r in range(world)]
        z = torch.cat([s[0] if name == "plain" else _masked(s[0], r) for r, s in enumerate(shards)], dim=1)
        b = torch.cat([s[2].logits if name == "plain" else _masked(s[2].logits, r) for r, s in enumerate(shards)], 1)
        z = z.detach().double().clone().requires_grad_(True)
        logp, logq = torch.log_softmax(z / case.temperature, -1), torch.log_softmax(b.double() / case.temperature, -1)
        kl = (logp.exp() * (logp - logq).masked_fill(z == float("-inf"), 0.0)).sum(-1)
        (v * kl).sum().backward()
        assert (kl > 0).all()
        for r in results:
            torch.testing.assert_close(r[name][0].double(), kl.detach(), atol=5 * tol, rtol=tol)
        grad = torch.cat([r[name][1] for r in results], dim=1)
        assert grad.dtype == dtype and torch.isfinite(grad).all(), name
        torch.testing.assert_close(grad.double(), z.grad, atol=tol, rtol=tol)
    same = case.logits.detach().clone().requires_grad_(True)  # pi_ref = pi: KL 0 and no gradient
    kl = kl_to_reference(same, case.logits, temperature=case.temperature)
    kl.sum().backward()
    assert kl.abs().max() < 10 * tol and same.grad.abs().max() < 10 * tol
    with pytest.raises(ValueError, match=r"ref_logits: expected the logits' shape"):
        kl_to_reference(case.logits, case.logits[:, :-1])


def _masked(z, rank):
    """z with -inf at every third entry of the first shard's rows (as a caller masks vocabulary padding)."""
    z = z.detach().clone()
    if rank == 0:
        z[:, ::3] = float("-inf")
    return z


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_entropy_gradient_matches_autograd_across_tp(dist_pools, world, dtype):
    """dH/dz_i = -(pi_i / T)(log pi_i + H) per shard, beside the log pi(k) gradient, against autograd on the
    gathered logits in float64."""
    width, T, K = 37, 23, 6
    case = make_case(T, width * world, K, temperature=0.7, dtype=dtype, seed=11)
    results = [rank_entropy_gradient(None, case, 5)] if world == 1 else \
        dist_pools(world).run(rank_entropy_gradient, shared=(case, 5))
    tol = TOL[dtype]
    w = torch.linspace(-1.0, 2.0, T, dtype=torch.float64)
    v = torch.linspace(0.5, -1.5, T, dtype=torch.float64)

    def reference(z, with_logp):
        z = z.detach().double().clone().requires_grad_(True)  # a fresh leaf: float64 .double() is the same tensor
        logp = torch.log_softmax(z / case.temperature, -1)
        H = -(logp.exp() * logp.masked_fill(z == float("-inf"), 0.0)).sum(-1)
        total = (v * H).sum()
        if with_logp:
            total = total + (w * logp.gather(1, case.topk.token_ids[:, None]).squeeze(-1)).sum()
        total.backward()
        return H.detach(), z.grad

    for name in ("topk", "exact", "masked"):
        z = case.logits if name != "masked" else torch.cat([_masked(case.shard(r, world)[0], r) for r in range(world)],
                                                            dim=1)
        H_ref, g_ref = reference(z, with_logp=name != "masked")
        for r in results:
            torch.testing.assert_close(r[name][0].double(), H_ref, atol=5 * tol, rtol=tol)
        grad = torch.cat([r[name][1] for r in results], dim=1)
        assert grad.dtype == dtype and torch.isfinite(grad).all(), name
        torch.testing.assert_close(grad.double(), g_ref, atol=tol, rtol=tol)


def _with_sub_rows(fn, sub_rows):
    """fn() with the torch path's sub-chunks set to `sub_rows` rows, so that a collective chunk holds several."""
    from megatron_pdm.vocab_parallel import core

    saved = core.SUB_CHUNK_BYTES, core.SUB_CHUNK_MIN_ROWS
    core.SUB_CHUNK_BYTES, core.SUB_CHUNK_MIN_ROWS = {"cpu": 0, "cuda": 0}, sub_rows
    try:
        return fn()
    finally:
        core.SUB_CHUNK_BYTES, core.SUB_CHUNK_MIN_ROWS = saved


def rank_all_stats_sub_chunked(group, case, chunk_size, sub_rows):
    return _with_sub_rows(lambda: rank_all_stats(group, case, chunk_size), sub_rows)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_several_sub_chunks_per_chunk_match_reference(dist_pools, world, dtype):
    # chunks of 9 rows read in sub-chunks of 2 (both ragged): the local sums of each sub-chunk are kept relative to
    # its own row max and rescaled once the chunk's global log Z is known
    width, T, K = 37, 23, 6
    case = make_case(T, width * world, K, temperature=0.7, dtype=dtype)
    results = dist_pools(world).run(rank_all_stats_sub_chunked, shared=(case, 9, 2))
    _assert_matches_reference(case, results, dtype)


def test_chunking_does_not_change_results():
    case = make_case(31, 50, 4, dtype=torch.float64)
    a = policy_statistics(case.logits, case.topk, "topk_kl", chunk_size=1)
    b = policy_statistics(case.logits, case.topk, "topk_kl", chunk_size=1000)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-13, rtol=1e-13)


# ---------------------------------------------------------------------------------------------- finite differences


def _fd(case: Case, kind, eps=1e-5, group=None, rank=0, world=1):
    """Central difference of D along g = e_k - pi (A = 1): (D(z + eps g) - D(z - eps g)) / (2 eps)."""
    z = case.logits.double()
    pi = ref_logpi(z, case.temperature).exp()
    g = torch.nn.functional.one_hot(case.topk.token_ids, z.shape[1]).double() - pi
    # the temperature divides the logits: moving z/T along g means moving z along T g
    step = eps * case.temperature * g

    def D(zz):
        c = Case(zz, case.behavior_logits.double(), case.topk, case.temperature)
        zs, topk, exact = c.shard(rank, world)
        return divergence(zs, exact if kind in EXACT_KINDS else topk, kind, group=group, temperature=c.temperature)

    return (D(z + step) - D(z - step)) / (2 * eps)


def rank_fd_check(group, case, kinds):
    group, rank, world = _rank_group(group)
    out = {}
    for kind, tail in kinds:
        zs, topk, exact = case.shard(rank, world)
        beh = exact if kind in EXACT_KINDS else topk
        dd = predicted_divergence_change(zs, beh, kind, tail=tail, group=group, temperature=case.temperature)
        out[kind, tail] = (dd, _fd(case, kind, group=group, rank=rank, world=world))
    return out


# rows whose formula is the exact derivative of the divergence itself
EXACT_DERIVATIVE_ROWS = [("binary_tv", "aggregated"), ("binary_kl", "aggregated"), ("topk_kl", "proportional"),
                         ("topk_tv", "aggregated"), ("topk_tv", "uniform"), ("kl", "aggregated"),
                         ("reverse_kl", "aggregated"), ("tv", "aggregated")]


@pytest.mark.parametrize("world", [1, 2])
def test_every_ddot_row_matches_finite_difference(dist_pools, world):
    case = make_case(12, 29 * world, 5, temperature=1.3, dtype=torch.float64)
    if world == 1:
        results = [rank_fd_check(None, case, EXACT_DERIVATIVE_ROWS)]
    else:
        results = dist_pools(world).run(rank_fd_check, shared=(case, EXACT_DERIVATIVE_ROWS))
    for r in results:
        for key, (dd, fd) in r.items():
            torch.testing.assert_close(dd, fd, atol=1e-8, rtol=1e-6, msg=f"{key}")
    # the reference's chain-rule Ddots agree with the same finite differences
    for kind, tail in EXACT_DERIVATIVE_ROWS:
        torch.testing.assert_close(ref_divergence_and_change(case, kind, tail)[1], results[0][kind, tail][1],
                                   atol=1e-8, rtol=1e-6)


def _structured_case(T, V, K, flat_tail, seed):
    """Top-K entries random; the tail either a single token or flat (equal logits) for both pi and mu."""
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(T, V, generator=g, dtype=torch.float64)
    b = z + 0.7 * torch.randn(T, V, generator=g, dtype=torch.float64)
    S = K + 1  # top-K plus a sampled token outside it
    if flat_tail:
        z[:, S:] = -1.0 + 0.3 * torch.randn(T, 1, generator=g, dtype=torch.float64)
        b[:, S:] = -0.5 + 0.3 * torch.randn(T, 1, generator=g, dtype=torch.float64)
    else:
        assert V == S + 1
    b[:, :K] += 8.0  # the first K ids are mu's top-K, id K is sampled (outside the top-K)
    log_mu = torch.log_softmax(b, -1)
    ids = torch.arange(K).expand(T, K).contiguous()
    k = torch.full((T,), K, dtype=torch.long)
    topk = BehaviorTopK(k, log_mu[:, K].contiguous(), ids, log_mu[:, :K].contiguous())
    return Case(z, b, topk, 1.0)


def test_tail_estimators_are_exact_under_their_tail_model():
    # aggregated: a one-token tail; uniform: a flat tail. Then each equals the exact KL(mu||pi) derivative.
    one = _structured_case(10, 8, 6, flat_tail=False, seed=1)
    flat = _structured_case(10, 40, 6, flat_tail=True, seed=2)
    for case, tail in ((one, "aggregated"), (one, "uniform"), (one, "proportional"), (flat, "uniform"),
                       (flat, "proportional")):
        dd = predicted_divergence_change(case.logits, case.topk, "topk_kl", tail=tail)
        exact = predicted_divergence_change(case.logits, case.exact, "kl")
        torch.testing.assert_close(dd, exact, atol=1e-12, rtol=1e-10, msg=tail)
        torch.testing.assert_close(exact, _fd(case, "kl"), atol=1e-8, rtol=1e-6)
    # and the top-K KL itself equals the exact KL when the tail is a single token
    torch.testing.assert_close(divergence(one.logits, one.topk, "topk_kl"), divergence(one.logits, one.exact, "kl"))


def test_proportional_tail_lies_between_uniform_and_aggregated():
    case = make_case(64, 300, 8, dtype=torch.float64)
    agg, uni, prop = (predicted_divergence_change(case.logits, case.topk, "topk_kl", tail=t) for t in TAILS)
    lo, hi = torch.minimum(agg, uni), torch.maximum(agg, uni)
    assert bool(((prop >= lo - 1e-15) & (prop <= hi + 1e-15)).all())


def test_tv_tail_model_has_no_effect():
    case = make_case(20, 60, 4, dtype=torch.float64)
    a, u = (predicted_divergence_change(case.logits, case.topk, "topk_tv", tail=t) for t in ("aggregated", "uniform"))
    torch.testing.assert_close(a, u, atol=0, rtol=0)


def test_pidot_sums_to_zero():
    case = make_case(8, 30, 3, dtype=torch.float64)
    pi = ref_logpi(case.logits, 1.0).exp()
    torch.testing.assert_close(ref_pidot(pi, case.topk.token_ids).sum(-1), torch.zeros(8, dtype=torch.float64))


def test_accurate_tails_for_peaked_policies():
    # pi puts 1 - 1e-12 on one token: 1 - sum_S pi_i would round to 0 in float32 and make top-K KL infinite
    V, K = 64, 4
    z = torch.full((1, V), -30.0)
    z[0, 0] = 0.0
    log_mu = torch.log_softmax(torch.linspace(0, -6, V)[None].double(), -1)
    topk = BehaviorTopK(torch.tensor([0]), log_mu[:, 0].float(), torch.arange(K)[None], log_mu[:, :K].float())
    d32 = divergence(z, topk, "topk_kl")
    d64 = divergence(z.double(), topk, "topk_kl")
    assert torch.isfinite(d32).all()
    torch.testing.assert_close(d32.double(), d64, rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------------- laws


@settings(max_examples=200, deadline=None)
@given(
    logits=st.lists(st.floats(-30, 30), min_size=2, max_size=40),
    k_frac=st.floats(0, 0.999),
    log_mu_k=st.floats(-25, -1e-6),
    kind=st.sampled_from(["binary_tv", "binary_kl"]),
)
def test_pdm_on_binary_divergence_is_the_ratio_sign(logits, k_frac, log_mu_k, kind):
    z = torch.tensor([logits], dtype=torch.float64)
    k = torch.tensor([int(k_frac * len(logits))])
    lm = torch.tensor([log_mu_k], dtype=torch.float64)
    topk = BehaviorTopK(k, lm, k[:, None], lm[:, None])
    dd = predicted_divergence_change(z, topk, kind)
    log_ratio = token_logprobs(z, k) - lm
    assert torch.equal(torch.sign(dd), torch.sign(log_ratio))


# ---------------------------------------------------------------------------------------------- bad inputs


def test_bad_inputs_raise_clear_errors():
    """Shapes, dtypes, options and kinds are checked on every call (no tensor value is read); the values of a
    BehaviorTopK are checked by `validate`, once, where the engine's output is parsed."""
    case = make_case(6, 20, 3)
    z, b = case.logits, case.topk
    with pytest.raises(ValueError, match="token_ids: expected shape"):
        token_logprobs(z, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="token_ids: expected integer ids"):
        token_logprobs(z, torch.zeros(6))
    with pytest.raises(ValueError, match="logits: expected a"):
        token_logprobs(z[0], b.token_ids)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(z, b.token_ids, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        entropy(z, chunk_size=0)
    big_k = BehaviorTopK(b.token_ids, b.token_logprobs, torch.zeros(6, 21, dtype=torch.long), torch.zeros(6, 21))
    with pytest.raises(ValueError, match=r"topk_ids: K=21 must be in \[1, vocab_size=20\]"):
        divergence(z, big_k, "topk_kl")
    with pytest.raises(ValueError, match="topk_logprobs: expected shape"):
        divergence(z, BehaviorTopK(b.token_ids, b.token_logprobs, b.topk_ids, b.topk_logprobs[:, :2]), "topk_kl")
    with pytest.raises(ValueError, match="behavior: 6 tokens, but logits have 5 rows"):
        divergence(z[:5], b, "topk_kl")
    with pytest.raises(ValueError, match="kind: unknown divergence 'js'"):
        divergence(z, b, "js")
    with pytest.raises(ValueError, match="needs BehaviorLogits"):
        divergence(z, b, "kl")
    with pytest.raises(ValueError, match="needs a BehaviorTopK"):
        divergence(z, case.exact, "topk_kl")
    with pytest.raises(ValueError, match="tail: unknown tail model"):
        predicted_divergence_change(z, b, "topk_kl", tail="flat")
    with pytest.raises(ValueError, match="behavior.logits: shape"):
        divergence(z, BehaviorLogits(b.token_ids, z[:, :10]), "kl")

    # values, at the boundary
    assert b.validate(20) is b
    with pytest.raises(ValueError, match=r"token_ids: id 20 at row 1 outside \[0, 20\)"):
        BehaviorTopK(torch.tensor([0, 20, 1, 1, 1, 1]), b.token_logprobs, b.topk_ids, b.topk_logprobs).validate(20)
    ids = b.topk_ids.clone()
    ids[3, 0] = 25
    with pytest.raises(ValueError, match="topk_ids: id .* at row 3 outside"):
        BehaviorTopK(b.token_ids, b.token_logprobs, ids, b.topk_logprobs).validate(20)
    dup = b.topk_ids.clone()
    dup[4, 1] = dup[4, 0]
    with pytest.raises(ValueError, match="topk_ids: duplicate ids"):
        BehaviorTopK(b.token_ids, b.token_logprobs, dup, b.topk_logprobs).validate(20)
    lp = b.topk_logprobs.clone()
    lp[0] = -0.1
    with pytest.raises(ValueError, match="topk_logprobs: probabilities .* sum to"):
        BehaviorTopK(b.token_ids, b.token_logprobs, b.topk_ids, lp).validate(20)
    for bad in (float("nan"), float("inf"), 0.01):
        lp[0, 0] = bad
        with pytest.raises(ValueError, match="topk_logprobs: value .* at row 0 is not a log-prob <= 0"):
            BehaviorTopK(b.token_ids, b.token_logprobs, b.topk_ids, lp).validate(20)
    # probability 0 (SGLang's finfo.min clamp of an underflowed entry, or -inf) and rounding above 0 are valid
    lp = b.topk_logprobs.clone()
    lp[0, 0], lp[1, 0] = torch.finfo(torch.float32).min, float("-inf")
    BehaviorTopK(b.token_ids, b.token_logprobs, b.topk_ids, lp).validate(20)
    one = torch.tensor([1e-6])
    BehaviorTopK(torch.tensor([3]), one, torch.tensor([[3]]), one[:, None]).validate(20)
    with pytest.raises(ValueError, match="token_ids: id 20 at row 0 outside"):
        BehaviorLogits(torch.tensor([20, 0, 0, 0, 0, 0]), z).validate(20)


def test_values_outside_the_math_contract_give_nan_not_an_error():
    """Without a host sync there is no raising on values: a NaN logit gives NaN statistics on its row, an id
    outside [0, V) a NaN log-prob (values are validated at the boundary instead)."""
    case = make_case(6, 20, 3)
    z = case.logits.clone()
    z[2, 5] = float("nan")
    s = policy_statistics(z, case.topk, "topk_kl")
    assert s.divergence[2].isnan() and s.logprobs[2].isnan() and s.entropy[2].isnan()
    rows = torch.tensor([0, 1, 3, 4, 5])
    assert torch.isfinite(s.divergence[rows]).all() and torch.isfinite(s.logprobs[rows]).all()
    lp = token_logprobs(case.logits, torch.tensor([0, 20, 1, -1, 1, 1]))
    assert lp.isnan().tolist() == [False, True, False, True, False, False]


def test_an_id_outside_the_vocabulary_is_nan_in_policy_statistics():
    """policy_statistics' log pi(k) for an id outside [0, V) is NaN, as token_logprobs' and the fused loss's, in
    the top-K and the exact branches, with and without a gradient (the regression: 0, a probability of 1)."""
    g = torch.Generator().manual_seed(0)
    z, mu = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    ids = torch.tensor([3, 9])
    top = mu.log_softmax(-1).topk(2, dim=-1)
    topk = BehaviorTopK(ids, torch.tensor([-1.0, -1.0]), top.indices, top.values)
    expected = token_logprobs(z, ids)
    assert expected.isnan().tolist() == [False, True]
    for beh, kind in ((topk, "topk_kl"), (BehaviorLogits(ids, mu), "kl")):
        for grad in (False, True):
            logp = policy_statistics(z.clone().requires_grad_(grad), beh, kind).logprobs
            assert logp.isnan().tolist() == [False, True], (kind, grad)
            assert logp[0].item() == expected[0].item(), (kind, grad)


def rank_nan(group, case):
    group, rank, world = _rank_group(group)
    z, topk, _ = case.shard(rank, world)
    if rank == world - 1:
        z = z.clone()
        z[1, 0] = float("nan")
    return divergence(z, topk, "topk_kl", group=group).isnan().tolist()


def test_nan_on_one_rank_is_nan_on_every_rank(dist_pools):
    rows = dist_pools(2).run(rank_nan, shared=(make_case(4, 40, 3),))
    assert rows == [[False, True, False, False]] * 2


def rank_count_collectives(group, case, chunk_size):
    """Collective calls and bytes of each public function on this rank's shard."""
    import torch.distributed as dist

    group, rank, world = _rank_group(group)
    z, topk, exact = case.shard(rank, world)
    counts = {}
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_single", "all_gather_into_tensor")
                 if hasattr(dist, name)}

    def counting(name):
        def fn(*args, **kwargs):
            counts[current]["calls"] += 1
            t = args[0] if name == "all_reduce" else args[1]
            counts[current]["bytes"] += t.numel() * t.element_size()
            return originals[name](*args, **kwargs)
        return fn

    try:
        for name in originals:
            setattr(dist, name, counting(name))
        calls = {
            "token_logprobs": lambda: token_logprobs(z, topk.token_ids, group=group, chunk_size=chunk_size),
            "entropy": lambda: entropy(z, group=group, chunk_size=chunk_size),
            "divergence_topk": lambda: divergence(z, topk, "topk_kl", group=group, chunk_size=chunk_size),
            "ddot_topk": lambda: predicted_divergence_change(z, topk, "topk_tv", group=group, chunk_size=chunk_size),
            "divergence_exact": lambda: divergence(z, exact, "kl", group=group, chunk_size=chunk_size),
            "ddot_exact": lambda: predicted_divergence_change(z, exact, "tv", group=group, chunk_size=chunk_size),
        }
        for current, fn in calls.items():
            counts[current] = {"calls": 0, "bytes": 0}
            fn()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return counts


def test_at_most_two_small_collectives_per_chunk(dist_pools):
    T, K, chunk = 20, 5, 6
    case = make_case(T, 2 * 300, K, dtype=torch.float32)
    chunks = -(-T // chunk)
    for counts in dist_pools(2).run(rank_count_collectives, shared=(case, chunk)):
        for name, c in counts.items():
            assert c["calls"] == 2 * chunks, name
            # O(T * K) bytes, never O(T * V): at most T * (K + 5) fp32 values per rank
            assert c["bytes"] <= T * (K + 5) * 4, (name, c["bytes"])


def rank_count_shard_passes(group, case, chunk_size, sub_rows):
    """Per public call on this rank: exp ops over [n, >= V_l] blocks of the shard, and collective calls."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    group, rank, world = _rank_group(group)
    z, topk, _ = case.shard(rank, world)
    width = z.shape[1]
    counts = {}

    class CountShardExps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ("exp", "exp_") and out.dim() == 2 and out.shape[1] >= width:
                counts[current]["exps"] += 1
            return out

    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_single", "all_gather_into_tensor")
                 if hasattr(dist, name)}

    def counting(name):
        def fn(*args, **kwargs):
            counts[current]["calls"] += 1
            return originals[name](*args, **kwargs)
        return fn

    calls = {
        "token_logprobs": lambda: token_logprobs(z, topk.token_ids, group=group, chunk_size=chunk_size),
        "entropy": lambda: entropy(z, group=group, chunk_size=chunk_size),
        "statistics_topk": lambda: policy_statistics(z, topk, "topk_kl", group=group, chunk_size=chunk_size),
    }
    try:
        for name in originals:
            setattr(dist, name, counting(name))
        for current, fn in calls.items():
            counts[current] = {"calls": 0, "exps": 0}
            with torch.no_grad(), CountShardExps():
                _with_sub_rows(fn, sub_rows)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return counts


@pytest.mark.parametrize("world", [2, 4])
def test_one_exp_per_entry_and_two_collectives_per_chunk(dist_pools, world):
    # chunks of 6 rows in sub-chunks of 2: exp runs once per logit (no second pass once log Z is known), and each
    # chunk makes exactly two collective calls, at any TP size
    T, chunk, sub = 20, 6, 2
    case = make_case(T, world * 300, 5, dtype=torch.float32)
    chunks = -(-T // chunk)
    sub_chunks = sum(-(-min(chunk, T - c0) // sub) for c0 in range(0, T, chunk))
    for counts in dist_pools(world).run(rank_count_shard_passes, shared=(case, chunk, sub)):
        for name, c in counts.items():
            assert c == {"calls": 2 * chunks, "exps": sub_chunks}, (name, c)


# ---------------------------------------------------------------------------------------------- threads (issue 56)


def _recorded_block_threads(monkeypatch, fn):
    """fn() with 2 intra-op threads, recording (thread id, its intra-op thread count) wherever a row block takes
    its scratch buffer (every sub-chunk of the forward, every block of the backward); then the caller's count and
    the count a fresh thread starts with (the process default), before the test's own count is put back."""
    import threading

    from megatron_pdm.vocab_parallel import core

    seen, get = [], core._Scratch.get

    def recording(self, *args, **kwargs):
        seen.append((threading.get_ident(), torch.get_num_threads()))
        return get(self, *args, **kwargs)

    monkeypatch.setattr(core._Scratch, "get", recording)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = fn()
        fresh = []
        probe = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        probe.start()
        probe.join()
        return out, seen, torch.get_num_threads(), fresh[0]
    finally:
        torch.set_num_threads(saved)


def test_cpu_row_blocks_run_on_one_thread_workers_and_match_the_reference(monkeypatch):
    # issue 56: each sub-chunk op ran on all intra-op threads and ended at their barrier, thousands of barriers a
    # call, so with other jobs on the cores a descheduled thread stalled the pass (7x its quiet time, megatron-core
    # 2x). Blocks now run on worker threads of one intra-op thread each, forward and both backward kernels, and the
    # caller's thread count and the process default are left as they were.
    import threading

    case = make_case(23, 37, 6, temperature=0.7, dtype=torch.bfloat16, seed=56)
    w = torch.linspace(-1.0, 2.0, 23, dtype=torch.float64)
    v = torch.linspace(0.5, -1.5, 23, dtype=torch.float64)

    def run():
        a = case.logits.detach().clone().requires_grad_(True)
        s = policy_statistics(a, case.topk, "topk_kl", temperature=case.temperature)
        (w * s.logprobs + v * s.entropy).sum().backward()  # `_logprob_entropy_backward`
        b = case.logits.detach().clone().requires_grad_(True)
        (w * token_logprobs(b, case.topk.token_ids, temperature=case.temperature)).sum().backward()  # the other
        return s, a.grad, b.grad

    (s, grad_ent, grad_lp), seen, caller, fresh = _recorded_block_threads(monkeypatch, lambda: _with_sub_rows(run, 2))
    assert seen and {n for _, n in seen} == {1}, f"row blocks ran on {sorted({n for _, n in seen})} threads"
    assert threading.get_ident() not in {t for t, _ in seen}
    assert (caller, fresh) == (2, 2)

    # the same per-block math as on one thread: the float64 reference on the bf16 logits, forward at the float32
    # tolerance, gradients (returned in bf16) at bf16's 1e-2 as in `_assert_matches_reference`
    tol = TOL[torch.bfloat16]
    lp_ref = ref_logpi(case.logits, case.temperature).gather(1, case.topk.token_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(s.logprobs.double(), lp_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(s.entropy.double(), ref_entropy(case.logits, case.temperature), atol=5 * tol, rtol=tol)
    d_ref, _ = ref_divergence_and_change(case, "topk_kl", "aggregated")
    torch.testing.assert_close(s.divergence.double(), d_ref, atol=tol, rtol=tol)
    z = case.logits.double().requires_grad_(True)
    lp = ref_logpi(z, case.temperature)
    (w * lp.gather(1, case.topk.token_ids[:, None]).squeeze(-1) + v * ref_entropy(z, case.temperature)).sum().backward()
    torch.testing.assert_close(grad_ent.double(), z.grad, atol=1e-2, rtol=1e-2)
    z.grad = None
    (w * ref_logpi(z, case.temperature).gather(1, case.topk.token_ids[:, None]).squeeze(-1)).sum().backward()
    torch.testing.assert_close(grad_lp.double(), z.grad, atol=1e-2, rtol=1e-2)


def test_row_block_workers_keep_inference_mode_and_raise_errors_in_the_caller(monkeypatch):
    # thread-local state: a worker runs in the caller's inference mode (writing into the caller's inference tensors
    # outside it is an error) and without autograd; an error in a block, or in starting a worker, reaches the
    # caller, and the thread counts are put back
    import threading

    from megatron_pdm.vocab_parallel import core

    case = make_case(9, 37, 4, dtype=torch.float32, seed=7)

    def under_inference():
        with torch.inference_mode():
            return token_logprobs(case.logits, case.topk.token_ids)

    got, seen, _, _ = _recorded_block_threads(monkeypatch, lambda: _with_sub_rows(under_inference, 2))
    assert seen and {n for _, n in seen} == {1}
    lp_ref = ref_logpi(case.logits, 1.0).gather(1, case.topk.token_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(got.double(), lp_ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])

    def failing(b0, b1, scratch):
        if b0 == 4:
            raise ValueError(f"block [{b0}, {b1})")

    def fails():
        with pytest.raises(ValueError, match=r"block \[4, 6\)"):
            core._for_blocks(0, 9, 2, failing, [None, None])  # two workers, five blocks

    _, _, caller, fresh = _recorded_block_threads(monkeypatch, fails)
    assert (caller, fresh) == (2, 2)

    class SecondWorkerCannotStart(threading.Thread):  # a thread limit reached while starting the workers
        started = 0

        def start(self):
            SecondWorkerCannotStart.started += 1
            if SecondWorkerCannotStart.started == 2:
                raise RuntimeError("can't start new thread")
            super().start()

    def cannot_start():
        with monkeypatch.context() as m:
            m.setattr(core.threading, "Thread", SecondWorkerCannotStart)
            with pytest.raises(RuntimeError, match="can't start new thread"):  # raised, not a hang at the barrier
                core._for_blocks(0, 9, 2, lambda b0, b1, scratch: None, [None, None])

    _, _, caller, fresh = _recorded_block_threads(monkeypatch, cannot_start)
    assert (caller, fresh) == (2, 2)


def test_a_worker_that_fails_before_the_barrier_raises_instead_of_hanging(monkeypatch):
    # review of issue 56's workers: a worker whose set-up raised (here torch.set_num_threads, e.g. a MemoryError)
    # never reached the start barrier, so the caller and the other worker waited on it forever
    import threading

    from megatron_pdm.vocab_parallel import core

    main, set_threads = threading.get_ident(), torch.set_num_threads

    def refuse_off_main(n):
        if threading.get_ident() != main:
            raise MemoryError("no memory for a thread pool")
        set_threads(n)

    def fails():
        with monkeypatch.context() as m:
            m.setattr(core.torch, "set_num_threads", refuse_off_main)
            with pytest.raises(MemoryError, match="no memory for a thread pool"):
                core._for_blocks(0, 9, 2, lambda b0, b1, scratch: None, [None, None])

    _, _, caller, fresh = _recorded_block_threads(monkeypatch, fails)
    assert (caller, fresh) == (2, 2)


def test_the_trainers_cpu_scopes_keep_the_row_block_workers(monkeypatch):
    # review of issue 56's workers: on a CPU the trainer runs its loss inside compat's cuda_to_cpu_scope (a function
    # mode) and, for bf16 / fp16 without native products, lowp_gemm_scope (a dispatch mode); any mode sent the row
    # blocks back inline on 2-thread ops, so the trainer never had the workers the benchmark measured. Modes that
    # declare the blocks unchanged outside them keep the workers (same values); any other mode still runs inline.
    from torch.overrides import TorchFunctionMode

    from megatron_pdm.compat import cpu
    from megatron_pdm.vocab_parallel import core

    case = make_case(11, 37, 4, dtype=torch.bfloat16, seed=8)

    def stats():
        return token_logprobs(case.logits, case.topk.token_ids)

    plain, seen, _, _ = _recorded_block_threads(monkeypatch, lambda: _with_sub_rows(stats, 2))
    assert {n for _, n in seen} == {1}

    def under_scopes():
        with cpu._CudaToCpuMode(), cpu._LowpGemmMode(torch.bfloat16):
            assert core._block_threads(case.logits) == 2
            return stats()

    scoped, seen, _, _ = _recorded_block_threads(monkeypatch, lambda: _with_sub_rows(under_scopes, 2))
    assert seen and {n for _, n in seen} == {1}, "the scopes sent the row blocks back to inline 2-thread ops"
    assert torch.equal(scoped, plain)  # same blocks, same single-thread ops

    class Other(TorchFunctionMode):  # a mode that says nothing: the blocks stay under it, inline
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def under_other():
        with Other():
            return stats()

    other, seen, _, _ = _recorded_block_threads(monkeypatch, lambda: _with_sub_rows(under_other, 2))
    assert seen and {n for _, n in seen} == {2}
    # 2-thread ops may sum in another order: float32's tolerance, as for every float32 comparison here
    torch.testing.assert_close(other, plain, atol=TOL[torch.float32], rtol=TOL[torch.float32])
