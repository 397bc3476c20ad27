"""Vocab-parallel divergences between the student pi and a teacher t for on-policy distillation (DESIGN.md 2.5b).

Exact (the teacher's logits shard, same layout as the student's): reverse KL(pi || t) is `kl_to_reference`;
forward KL(t || pi) and the generalized Jensen-Shannon divergence (TRL's GKD) run their own chunked pass here.
Top-K (a teacher that reports only its top-K log-probs, an engine): the same divergences over the categories of
S = TopK(t) u {k} plus one tail bucket, the masks' top-K view of a behavior policy (`core._topk_terms`).

Every function takes the logits shard [T, V/tp] of this rank, an explicit `group` (None: one process) and is
differentiable in the student's logits only; no rank gathers the vocabulary, memory is a few [rows, V/tp] blocks.
"""

from __future__ import annotations

import math

import torch

from .behavior import BehaviorTopK
from .core import (
    _all_gather,
    _all_reduce,
    _check_device,
    _check_logits,
    _check_options,
    _chunk_rows,
    _compute_dtype,
    _for_blocks,
    _group_info,
    _owned,
    _scaled,
    _scratches,
    _sub_rows,
    _support_pass,
    _wsum,
    kl_to_reference,
)

DISTILL_KINDS = ("reverse", "forward", "jsd")


def _check_kind(kind: str, beta: float) -> None:
    if kind not in DISTILL_KINDS:
        raise ValueError(f"kind: expected one of {', '.join(DISTILL_KINDS)}, got {kind!r}")
    if not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
        raise ValueError(f"beta: must be a number in [0, 1], got {beta!r}")


def _effective(kind: str, beta: float) -> str:
    """TRL's GKD convention: jsd at beta 0 is the forward KL, at beta 1 the reverse KL (not the mixture's 0)."""
    if kind == "jsd" and beta == 0.0:
        return "forward"
    if kind == "jsd" and beta == 1.0:
        return "reverse"
    return kind


def _mixture(lp: torch.Tensor, lt: torch.Tensor, beta: float) -> torch.Tensor:
    """log m for m = (1 - beta) pi + beta t, 0 < beta < 1, from log pi and log t."""
    return torch.logaddexp(lp + math.log1p(-beta), lt + math.log(beta))


def _row_sums(lp: torch.Tensor, lt: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """[n, 2] per-row partial sums over this shard's entries: forward (sum t (lt - lp), 0); jsd
    (sum t (lt - lm), sum pi (lp - lm)); 0 log 0 = 0 (`_wsum`)."""
    p, t = lp.exp(), lt.exp()
    if kind == "forward":
        return torch.stack([_wsum(t, lt - lp), torch.zeros_like(lp[:, 0])], -1)
    lm = _mixture(lp, lt, beta)
    return torch.stack([_wsum(t, lt - lm), _wsum(p, lp - lm)], -1)


def _divergence_pass(logits, teacher_logits, kind, beta, *, group, temperature, chunk_size):
    """(lse [T, 2] of pi and t, sums [T, 2] of `_row_sums`) reduced over the group. Per chunk of rows two reads of
    both shards (the local log Z, then the sums against the global log Z: the mixture needs the global log-probs)
    and two collectives: an all-gather of [n, 2] local log Z and an all-reduce of [n, 2] sums. Sub-chunks are
    cache-sized; no buffer larger than a few [sub, V/tp] blocks."""
    world, _ = _group_info(group)
    T = logits.shape[0]
    dtype = _compute_dtype(logits)
    rows, sub = _chunk_rows(chunk_size, logits), _sub_rows(logits)
    lse = logits.new_zeros(T, 2, dtype=dtype)
    sums = logits.new_zeros(T, 2, dtype=dtype)

    def local_lse(s0, s1, _scratch):
        lse[s0:s1, 0] = torch.logsumexp(_scaled(logits[s0:s1], temperature, dtype), -1)
        lse[s0:s1, 1] = torch.logsumexp(_scaled(teacher_logits[s0:s1], temperature, dtype), -1)

    def partial(s0, s1, _scratch):
        lp = _scaled(logits[s0:s1], temperature, dtype) - lse[s0:s1, 0:1]
        lt = _scaled(teacher_logits[s0:s1], temperature, dtype) - lse[s0:s1, 1:2]
        sums[s0:s1] = _row_sums(lp, lt, kind, beta)

    scratches = _scratches(1, 1, dtype, logits)  # one per worker thread; the blocks allocate their own temporaries
    for c0 in range(0, T, rows):
        c1 = min(c0 + rows, T)
        _for_blocks(c0, c1, sub, local_lse, scratches)
        lse[c0:c1] = torch.logsumexp(_all_gather(lse[c0:c1], group, world), dim=0)  # collective 1
        _for_blocks(c0, c1, sub, partial, scratches)
        _all_reduce(sums[c0:c1], group, world)  # collective 2
    return lse, sums


def _divergence_backward(logits, teacher_logits, lse, sums, grad_out, kind, beta, *, temperature, chunk_size):
    """d/dz_r sum_t g_t D_t, recomputed block by block from both shards and their log Z (no collective):
      forward  (pi_r - t_r) / T
      jsd      (1 - beta) pi_r (log pi_r - log m_r - KL(pi || m)) / T     (dJSD/dpi_i = (1 - beta)(log pi_i - log m_i)
               up to a constant; the softmax's Jacobian subtracts its pi-mean, KL(pi || m) = sums[:, 1])
    0 where pi_r = 0 (a -inf logit gets no gradient)."""
    dtype = _compute_dtype(logits)
    rows = min(_chunk_rows(chunk_size, logits), _sub_rows(logits))
    grad = torch.empty_like(logits)
    scale = grad_out.to(dtype) / temperature

    def block(c0, c1, _scratch):
        lp = _scaled(logits[c0:c1], temperature, dtype) - lse[c0:c1, 0:1]
        lt = _scaled(teacher_logits[c0:c1], temperature, dtype) - lse[c0:c1, 1:2]
        p = lp.exp()
        if kind == "forward":
            g = p - lt.exp()
        else:
            g = (1.0 - beta) * p * (lp - _mixture(lp, lt, beta) - sums[c0:c1, 1:2])
            g = g.masked_fill(p == 0, 0.0)
        grad[c0:c1] = g * scale[c0:c1, None]

    _for_blocks(0, logits.shape[0], rows, block, _scratches(1, 1, dtype, logits))
    return grad


class _VocabParallelDistill(torch.autograd.Function):
    """Forward: `_divergence_pass`; backward: `_divergence_backward` from the saved shards and log Z's.
    Differentiable in the student's logits only."""

    @staticmethod
    def forward(ctx, logits, teacher_logits, kind, beta, group, temperature, chunk_size):
        lse, sums = _divergence_pass(logits, teacher_logits, kind, beta, group=group, temperature=temperature,
                                     chunk_size=chunk_size)
        ctx.save_for_backward(logits, teacher_logits, lse, sums)
        ctx.options = (kind, beta, temperature, chunk_size)
        return sums[:, 0].clone() if kind == "forward" else beta * sums[:, 0] + (1.0 - beta) * sums[:, 1]

    @staticmethod
    def backward(ctx, grad_out):
        logits, teacher_logits, lse, sums = ctx.saved_tensors
        kind, beta, temperature, chunk_size = ctx.options
        grad = _divergence_backward(logits, teacher_logits, lse, sums, grad_out, kind, beta, temperature=temperature,
                                    chunk_size=chunk_size) if ctx.needs_input_grad[0] else None
        return grad, None, None, None, None, None, None


def distill_divergence(logits, teacher_logits, kind: str, *, beta: float = 0.5, group=None, temperature=1.0,
                       chunk_size=None) -> torch.Tensor:
    """D(pi, t) per token [T], exact over the whole vocabulary, differentiable in `logits` (not in the teacher's):
    pi = softmax(logits / T), t = softmax(teacher_logits / T), both [T, V/tp] shards of one layout.

      reverse  KL(pi || t) = sum_i pi_i (log pi_i - log t_i)         (`kl_to_reference`)
      forward  KL(t || pi) = sum_i t_i (log t_i - log pi_i)
      jsd      beta KL(t || m) + (1 - beta) KL(pi || m),  m = beta t + (1 - beta) pi   (TRL's generalized JSD)

    jsd at beta = 0 is the forward KL and at beta = 1 the reverse KL (TRL's convention). The limits of the mixture
    are those up to scaling: JSD_beta / beta -> KL(t || pi) as beta -> 0 and JSD_beta / (1 - beta) -> KL(pi || t)
    as beta -> 1 (first order in beta: KL(pi || m) = O(beta^2), KL(t || m) -> KL(t || pi)).
    """
    _check_logits(logits)
    _check_logits(teacher_logits, "teacher_logits")
    _check_options(temperature, chunk_size)
    _check_kind(kind, beta)
    if teacher_logits.shape != logits.shape:
        raise ValueError(f"teacher_logits: expected the logits' shape {tuple(logits.shape)}, got "
                         f"{tuple(teacher_logits.shape)}")
    _check_device("teacher_logits", teacher_logits, logits)
    kind = _effective(kind, float(beta))
    if kind == "reverse":
        return kl_to_reference(logits, teacher_logits, group=group, temperature=temperature, chunk_size=chunk_size)
    return _VocabParallelDistill.apply(logits, teacher_logits.detach(), kind, float(beta), group, float(temperature),
                                       chunk_size)


# ----------------------------------------------------------------------------------------------------------
# top-K: the teacher's top-K log-probs (an engine)


def _support_backward(logits, support_ids, lse, grad_sup, *, group, temperature, chunk_size):
    """d/dz_r sum_{t,j} g_tj log pi_t(S_tj) = (sum_j g_tj [r = S_tj] - pi_r sum_j g_tj) / T, block by block from the
    shard and log Z (a repeated id gets each of its columns' gradients). No collective."""
    _, rank = _group_info(group)
    T, width = logits.shape
    dtype = _compute_dtype(logits)
    rows = min(_chunk_rows(chunk_size, logits), _sub_rows(logits))
    grad = torch.empty_like(logits)
    g = grad_sup.to(dtype)
    total = g.sum(-1)

    def block(c0, c1, _scratch):
        p = (_scaled(logits[c0:c1], temperature, dtype) - lse[c0:c1, None]).exp()
        b = p * -total[c0:c1, None]
        owned, idx = _owned(support_ids[c0:c1], rank * width, width)
        b.scatter_add_(1, idx, torch.where(owned, g[c0:c1], 0.0))
        grad[c0:c1] = b / temperature

    _for_blocks(0, T, rows, block, _scratches(1, 1, dtype, logits))
    return grad


class _VocabParallelSupport(torch.autograd.Function):
    """(log pi at support ids [T, J], differentiable; pi mass outside the support [T], summed directly over the
    complement, not differentiable). Forward: `core._support_pass` (two collectives per chunk); backward:
    `_support_backward`."""

    @staticmethod
    def forward(ctx, logits, support_ids, group, temperature, chunk_size):
        lse, logp, _, rest, _ = _support_pass(logits, support_ids, group=group, temperature=temperature,
                                              chunk_size=chunk_size, need_probs=True, need_entropy=False)
        ctx.save_for_backward(logits, support_ids, lse)
        ctx.options = (group, temperature, chunk_size)
        ctx.mark_non_differentiable(rest)
        return logp.clone(), rest.clone()

    @staticmethod
    def backward(ctx, grad_logp, _grad_rest):
        logits, support_ids, lse = ctx.saved_tensors
        group, temperature, chunk_size = ctx.options
        grad = _support_backward(logits, support_ids, lse, grad_logp, group=group, temperature=temperature,
                                 chunk_size=chunk_size) if ctx.needs_input_grad[0] else None
        return grad, None, None, None, None


def _category_divergence(lp, lt, w, kind, beta):
    """sum_c w_c f(p_c, t_c) over categories [T, C] of log-probs lp (student, differentiable) and lt (teacher), both
    finite (clamped by the caller): forward t (lt - lp), reverse p (lp - lt), jsd beta t (lt - lm) + (1 - beta)
    p (lp - lm). A category with w_c = 0 or zero probability adds 0 (and no NaN gradient: every operand is
    finite)."""
    p, t = lp.exp(), lt.exp()
    if kind == "forward":
        terms = t * (lt - lp)
    elif kind == "reverse":
        terms = p * (lp - lt)
    else:
        lm = _mixture(lp, lt, beta)
        terms = beta * t * (lt - lm) + (1.0 - beta) * p * (lp - lm)
    return (w * terms).sum(-1)


def distill_divergence_topk(logits, teacher: BehaviorTopK, kind: str, *, beta: float = 0.5, group=None,
                            temperature=1.0, chunk_size=None) -> torch.Tensor:
    """D(pi, t) per token [T] over the categories of S = TopK(t) u {k} and one tail bucket, differentiable in
    `logits`: teacher.token_ids the sampled tokens k, token_logprobs log t(k), topk_ids / topk_logprobs the
    teacher's top-K (an engine's prefill log-probs). With pi_tail = sum_{i not in S} pi_i (summed directly over the
    complement) and t_tail = max(1 - sum_S t_i, 0), both 0 when S is the whole vocabulary:

      reverse  sum_S pi_i log(pi_i / t_i) + pi_tail log(pi_tail / t_tail)
      forward  sum_S t_i log(t_i / pi_i) + t_tail log(t_tail / pi_tail)
      jsd      the generalized JSD of the same |S| + 1 categories

    This is the masks' top-K view of a behavior policy (`core._topk_terms`: topk_kl is `forward` here): the tail is
    one category whose log-probs are clamped at finfo.tiny, the teacher's log-probs at 0 from above (an engine's
    rounding). The gradient is the exact derivative of this estimate: inside the tail it spreads as pi_j / pi_tail
    (the masks' "proportional" tail model). At |S| = V it equals `distill_divergence`; it approaches it as K grows.
    """
    _check_logits(logits)
    _check_options(temperature, chunk_size)
    _check_kind(kind, beta)
    world, _ = _group_info(group)
    V = logits.shape[1] * world
    teacher.check_shapes(V)
    _check_device("teacher.topk_ids", teacher.topk_ids, logits)
    kind = _effective(kind, float(beta))
    support = torch.cat([teacher.token_ids[:, None], teacher.topk_ids], 1)
    lp_sup, rest = _VocabParallelSupport.apply(logits, support, group, float(temperature), chunk_size)
    dtype, tiny = lp_sup.dtype, torch.finfo(lp_sup.dtype).tiny
    low = torch.finfo(dtype).min
    lt_k = teacher.token_logprobs.to(dtype).clamp(min=low, max=0.0)
    lt_top = teacher.topk_logprobs.to(dtype).clamp(min=low, max=0.0)
    in_top = (teacher.topk_ids == teacher.token_ids[:, None]).any(-1)
    w_k = (~in_top).to(dtype)  # k joins S only when it is not among the top-K
    covers = (teacher.k + w_k) >= V
    p_sup = lp_sup.exp()
    # pi_tail: the direct sum (accurate however small), carrying the gradient of 1 - sum_S pi_i
    s = -(p_sup[:, 1:].sum(-1) + w_k * p_sup[:, 0])
    pi_tail = torch.where(covers, 0.0, rest + (s - s.detach()))
    t_tail = torch.where(covers, 0.0, (1.0 - lt_top.exp().sum(-1) - w_k * lt_k.exp()).clamp_min(0.0))
    lp = torch.cat([lp_sup[:, 1:], lp_sup[:, :1], pi_tail.clamp_min(tiny).log()[:, None]], 1).clamp_min(low)
    lt = torch.cat([lt_top, lt_k[:, None], t_tail.clamp_min(tiny).log()[:, None]], 1)
    ones = torch.ones_like(lt_top)
    w = torch.cat([ones, w_k[:, None], (~covers).to(dtype)[:, None]], 1)
    return _category_divergence(lp, lt, w, kind, float(beta))
