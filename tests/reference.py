"""Independent float64 single-process full-vocabulary reference (plain torch), and random test cases.

Written from DESIGN.md without looking at the vocab-parallel code: pi and mu are full [T, V] tensors, mu's tail
is 1 - sum_S (all the engine gives), pi's tail and 1 - pi_k are summed over the complement (the same numbers,
without the cancellation of 1 - sum when they are tiny), 0 log 0 = 0 (-inf logits, probability-0 engine entries),
and every Ddot is computed by the chain rule through the full pidot vector (not the closed forms), except the
aggregated/uniform top-K KL tails, which are estimator definitions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_pdm.vocab_parallel import BehaviorLogits, BehaviorTopK


@dataclass
class Case:
    logits: torch.Tensor  # [T, V] training logits (any dtype)
    behavior_logits: torch.Tensor  # [T, V] mu's logits
    topk: BehaviorTopK
    temperature: float

    @property
    def exact(self) -> BehaviorLogits:
        return BehaviorLogits(self.topk.token_ids, self.behavior_logits)

    def shard(self, rank: int, world: int):
        """(logits shard, BehaviorTopK, BehaviorLogits shard) of rank `rank`."""
        width = self.logits.shape[1] // world
        sl = slice(rank * width, (rank + 1) * width)
        return self.logits[:, sl], self.topk, BehaviorLogits(self.topk.token_ids, self.behavior_logits[:, sl])


def make_case(T, V, K, *, temperature=1.0, dtype=torch.float32, noise=0.5, scale=2.0, seed=None,
              logits=None) -> Case:
    """Random logits z (or the given float64 `logits` [T, V]), behavior logits b = z + noise; k ~ mu, half the rows
    forced outside TopK(mu, K); top-K entries in random order (engines need not sort)."""
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))
    z = scale * torch.randn(T, V, generator=g, dtype=torch.float64) if logits is None else logits.double()
    b = z + noise * torch.randn(T, V, generator=g, dtype=torch.float64)
    z = z.to(dtype)
    log_mu = torch.log_softmax(b / temperature, -1)
    top_lp, top_ids = log_mu.topk(K, dim=-1)
    perm = torch.argsort(torch.rand(T, K, generator=g), dim=-1)
    top_ids, top_lp = top_ids.gather(1, perm), top_lp.gather(1, perm)
    mu = log_mu.exp()
    outside = mu.clone().scatter_(1, top_ids, 0.0)
    force_out = torch.rand(T, generator=g) < 0.5
    if K == V:
        force_out[:] = False
    probs = torch.where(force_out[:, None], outside, mu)
    k = torch.multinomial(probs, 1, generator=g).squeeze(-1)
    behavior = BehaviorTopK(k, log_mu.gather(1, k[:, None]).squeeze(-1), top_ids, top_lp)
    return Case(z, b, behavior, temperature)


def ref_logpi(logits, temperature):
    return torch.log_softmax(logits.double() / temperature, -1)


def ref_pidot(pi, k):
    """pidot / A for g = A (e_k - pi): pi_i (delta_ik - pi_i - pi_k + ||pi||^2), [T, V]."""
    onehot = torch.nn.functional.one_hot(k, pi.shape[1]).double()
    pk = pi.gather(1, k[:, None])
    p2 = (pi * pi).sum(-1, keepdim=True)
    return pi * (onehot - pi - pk + p2)


def _plogq(p, log_ratio):
    """p log_ratio with 0 log 0 = 0."""
    return torch.where(p > 0, p * log_ratio, 0.0)


def ref_entropy(logits, temperature):
    lp = ref_logpi(logits, temperature)
    return -_plogq(lp.exp(), lp).sum(-1)


def ref_support(b: BehaviorTopK, V):
    S = torch.zeros(b.num_tokens, V, dtype=torch.bool, device=b.token_ids.device)
    S.scatter_(1, b.topk_ids, True)
    S.scatter_(1, b.token_ids[:, None], True)
    mu_S = torch.zeros(b.num_tokens, V, dtype=torch.float64, device=b.token_ids.device)
    mu_S.scatter_(1, b.token_ids[:, None], b.token_logprobs.double().exp()[:, None])
    mu_S.scatter_(1, b.topk_ids, b.topk_logprobs.double().exp())
    return S, mu_S


def ref_divergence_and_change(case: Case, kind: str, tail: str = "aggregated", logits=None):
    """(D [T], Ddot/A [T]) of `kind` in float64 on the full vocabulary."""
    z = case.logits if logits is None else logits
    T, V = z.shape
    pi = ref_logpi(z, case.temperature).exp()
    b = case.topk
    k = b.token_ids
    pidot = ref_pidot(pi, k)
    pi_k = pi.gather(1, k[:, None]).squeeze(-1)
    if kind in ("kl", "reverse_kl", "tv"):
        mu = ref_logpi(case.behavior_logits, case.temperature).exp()
        if kind == "kl":
            return _plogq(mu, mu.log() - pi.log()).sum(-1), -torch.where(mu > 0, mu * pidot / pi, 0.0).sum(-1)
        if kind == "reverse_kl":
            lr = pi.log() - mu.log()
            return _plogq(pi, lr).sum(-1), torch.where(pi > 0, pidot * (lr + 1), 0.0).sum(-1)
        s = torch.sign(pi - mu)
        return 0.5 * (pi - mu).abs().sum(-1), 0.5 * (s * pidot).sum(-1)

    mu_k = b.token_logprobs.double().exp()
    pidot_k = pidot.gather(1, k[:, None]).squeeze(-1)
    if kind == "binary_tv":
        return (pi_k - mu_k).abs(), torch.sign(pi_k - mu_k) * pidot_k
    if kind == "binary_kl":
        mu_notk, pi_notk = -torch.expm1(b.token_logprobs.double()), pi.scatter(1, k[:, None], 0.0).sum(-1)
        d = _plogq(mu_k, torch.log(mu_k / pi_k)) + _plogq(mu_notk, torch.log(mu_notk / pi_notk))
        dd_dpi = -mu_k / pi_k + mu_notk / pi_notk
        return d, dd_dpi * pidot_k
    S, mu_S = ref_support(b, V)
    Sd = S.double()
    pi_tail = (pi * (1 - Sd)).sum(-1)
    mu_tail = torch.where(S.all(-1), 0.0, (1 - mu_S.sum(-1)).clamp_min(0))  # no tail when S is the vocabulary
    pidot_tail = (pidot * (1 - Sd)).sum(-1)
    if kind == "topk_tv":
        d = 0.5 * (((pi - mu_S).abs() * Sd).sum(-1) + (pi_tail - mu_tail).abs())
        dd = 0.5 * ((torch.sign(pi - mu_S) * pidot * Sd).sum(-1) + torch.sign(pi_tail - mu_tail) * pidot_tail)
        return d, dd
    assert kind == "topk_kl"
    ratio = torch.where(S, mu_S / pi, 0.0)
    d = (torch.where(S & (mu_S > 0), mu_S * torch.log(torch.where(S & (mu_S > 0), ratio, 1.0)), 0.0)).sum(-1)
    d = d + _plogq(mu_tail, torch.log(mu_tail / pi_tail))
    if tail == "proportional":  # the chain rule through topk_kl itself
        return d, -(ratio * pidot).sum(-1) - torch.where(mu_tail > 0, mu_tail / pi_tail, 0.0) * pidot_tail
    head = (pi_k - mu_k) + (pi * (mu_S - pi) * Sd).sum(-1)
    tail_term = pi_tail * (mu_tail - pi_tail)
    if tail == "uniform":
        tail_term = tail_term / (V - S.sum(-1)).clamp_min(1).double()
    return d, head + tail_term


def tv_sign_slack(logits, topk: BehaviorTopK, kind, *, temperature=1.0, behavior_logits=None, rel=1e-4, floor=1e-6):
    """[T] float64: how far Ddot / A of a TV kind may legitimately differ between two correct implementations.

    TV's Ddot weighs each category c (a vocabulary entry; for topk_tv the entries of S and the tail bucket) by
    s_c = sign(pi_c - mu_c), which flips on rounding noise where pi_c ~ mu_c: flipping s_c moves Ddot by |pidot_c|
    (1/2 * 2 |pidot_c|; binary_tv: 2 |pidot_k|). The slack sums that over the near-tied categories,
    |pi_c - mu_c| <= rel (pi_c + mu_c) + floor (floor covers mu's 1 - sum tail, ~1e-6 in float32). Other kinds: 0.
    Computed in float64 on the logits' device; compare |Ddot - Ddot_ref| <= tol + slack.
    """
    z = logits.double()
    T = z.shape[0]
    if kind not in ("tv", "topk_tv", "binary_tv"):
        return torch.zeros(T, dtype=torch.float64, device=z.device)
    pi = torch.softmax(z / temperature, -1)
    k = topk.token_ids
    pidot = ref_pidot(pi, k)
    if kind == "tv":
        p, m, pd, weight = pi, torch.softmax(behavior_logits.double() / temperature, -1), pidot, 1.0
    elif kind == "binary_tv":
        p, pd, weight = pi.gather(1, k[:, None]), pidot.gather(1, k[:, None]), 2.0
        m = topk.token_logprobs.double().exp()[:, None]
    else:
        S, mu_S = ref_support(topk, z.shape[1])
        Sd = S.double()
        p = torch.cat([pi * Sd, (1 - (pi * Sd).sum(-1, keepdim=True)).clamp_min(0)], -1)
        m = torch.cat([mu_S, (1 - mu_S.sum(-1, keepdim=True)).clamp_min(0)], -1)
        pd = torch.cat([pidot * Sd, (pidot * (1 - Sd)).sum(-1, keepdim=True)], -1)
        weight = 1.0
    tied = (p - m).abs() <= rel * (p + m) + floor
    return weight * (tied * pd.abs()).sum(-1)


def assert_ddot_close(dd, dd_ref, slack, *, atol, rtol, msg=""):
    """|dd - dd_ref| <= atol + rtol |dd_ref| + slack, row by row (slack from `tv_sign_slack`)."""
    dd, dd_ref = dd.double().to(dd_ref.device), dd_ref.double()
    err = (dd - dd_ref).abs()
    bound = atol + rtol * dd_ref.abs() + slack
    bad = ~(err <= bound)
    assert not bad.any(), f"{msg}: rows {bad.nonzero().squeeze(-1).tolist()[:8]} err {err[bad].tolist()[:8]} > " \
                          f"bound {bound[bad].tolist()[:8]}"
