"""The policy loss with PPO / DPPO / PDM masks on a vocab-parallel logits shard (DESIGN.md section 3.2).

`policy_loss` is what a trainer (ours, or a verl / slime user's) calls per micro-batch with its own logits
shard and tensor-parallel group. The returned loss is a *contribution*: summing it over the micro-batches of an
optimizer step and over data-parallel ranks gives the aggregated loss of the global batch, because the
denominator (`normalizer`) is the global token or sequence count of the step, computed once by
`loss_normalizer` (with Megatron DDP, which averages gradients over DP, multiply the loss by the DP size).

Devices and host syncs: every per-token input lives on the logits' device (a clear error otherwise), every tensor
made here goes there too, and nothing reads a tensor back to the host: a CUDA micro-batch queues its kernels
without waiting. Validate inputs once per step instead (`BehaviorTopK.validate` where the rollout is parsed,
finite rewards in `compute_advantages`); only `Metrics.reduce`, once per step for logging, copies to the host.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_pdm.vocab_parallel import (
    BehaviorLogits,
    BehaviorTopK,
    PolicyStatistics,
    fused_output_loss,
    kl_to_reference,
    policy_statistics,
    token_logprobs,
)

from .config import ObjectiveConfig
from .masks import TrustRegionMask, dppo_mask, pdm_mask, ppo_mask, ratio_direction
from .metrics import Metrics, collective_device


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # scalar contribution to the global aggregated loss
    per_token_loss: torch.Tensor  # [T], before aggregation (zero where loss_mask is 0)
    mask: TrustRegionMask
    stats: PolicyStatistics
    metrics: Metrics


def _check_per_token(name, t, T, device):
    if not isinstance(t, torch.Tensor) or t.shape != (T,):
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected shape [{T}] matching the logits rows, got {shape}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, but the logits are on {device}; move it there once per step")


def _sequence_sums(values: torch.Tensor, sequence_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, first), s [T] or [T, C] like `values`, first [T]: s_t = sum of `values` over the tokens of t's sequence,
    and first_t marks one token of each sequence. By sorting (any integer ids, in any order), so that no id count or
    maximum is read to the host."""
    ids, order = sequence_ids.sort(stable=True)
    csum = torch.cat([values.new_zeros((1, *values.shape[1:])), values[order].cumsum(0)])
    lo = torch.searchsorted(ids, sequence_ids, right=False)  # where t's sequence starts in sorted order
    hi = torch.searchsorted(ids, sequence_ids, right=True)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return csum[hi] - csum[lo], pos == lo


def _token_weights(loss_mask, sequence_ids, aggregation, sequence_lengths=None):
    """Per-token aggregation weights before the global normaliser."""
    m = loss_mask.to(torch.float64)
    if aggregation == "seq_mean_token_mean":
        if sequence_lengths is not None:
            return m / sequence_lengths.to(torch.float64).clamp_min(1.0)
        if sequence_ids is None:
            raise ValueError("sequence_ids: required for aggregation 'seq_mean_token_mean'")
        lengths, _ = _sequence_sums(m, sequence_ids)
        return m / lengths.clamp_min(1.0)
    return m


def loss_normalizer(loss_mask, sequence_ids, aggregation: str, *, group=None) -> torch.Tensor:
    """The global denominator of one optimizer step: the number of loss tokens (token_mean) or of sequences with
    at least one loss token (seq_*), summed over `group` (the data-parallel group). Call it on all the
    micro-batches of the step at once (concatenated), before the first forward.

    Returns a float64 scalar on the inputs' device (loss_mask [T] and sequence_ids [T] on one device); the
    all-reduce runs there (`collective_device`: a CPU input bound for an NCCL-only group goes to the current CUDA
    device). Reads nothing back to the host."""
    m = loss_mask.detach().to(torch.float64)
    if aggregation == "token_mean":
        n = m.sum()
    else:
        if sequence_ids is None:
            raise ValueError(f"sequence_ids: required for aggregation {aggregation!r}")
        _check_per_token("sequence_ids", sequence_ids, m.shape[0], m.device)
        per_sequence, first = _sequence_sums(m, sequence_ids)
        n = ((per_sequence > 0) & first).to(torch.float64).sum()
    if group is not None and dist.get_world_size(group) > 1:
        n = n.to(collective_device(group, n.device))
        dist.all_reduce(n, group=group)
    return n


def per_sequence_sums(values: torch.Tensor, sequence_ids: torch.Tensor, *, group=None,
                      num_sequences: int | None = None) -> torch.Tensor:
    """[T, C] -> [T, C] float64: each token's sum of `values` over the tokens of its sequence. With `group` (context
    parallelism: a sequence's tokens split over the group's ranks, `sequence_ids` the same rows on each) the sums
    cover the whole sequence: one all-reduce of [num_sequences, C]. Float64, so that a cumulative sum over many
    sequences keeps each one's digits."""
    values = values.to(torch.float64)
    if group is None or dist.get_world_size(group) == 1:
        return _sequence_sums(values, sequence_ids)[0]
    if num_sequences is None:
        raise ValueError("num_sequences: required with a sequence group (the rows every rank's sequence_ids index)")
    sums = values.new_zeros((num_sequences, values.shape[1])).index_add_(0, sequence_ids, values)
    device = sums.device
    sums = sums.to(collective_device(group, device))
    dist.all_reduce(sums, group=group)
    return sums.to(device)[sequence_ids]


def sequence_corrections(config: ObjectiveConfig, log_k: torch.Tensor, on: torch.Tensor, sequence_ids, *,
                         group=None, num_sequences=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_weight, rejected, vetoed), each [T]: the log of the correction's K at `config.correction_level`
    (token: log k_t; sequence: sum over the sequence's loss tokens of log k_t; geometric: their mean), and whether t's
    sequence leaves the loss by `config.rejection` (k1: |mean log k| > threshold; k3: mean (k - 1 - log k) >
    threshold) or by the token veto (some k_t < veto_threshold). log_k = log pi_old(k) - log mu(k), clamped to
    [-80, 80] first (beyond, a ratio is 0 or infinite to any cap; an infinite log would make the sums NaN)."""
    log_k = log_k.clamp(-80.0, 80.0)
    if not config.per_sequence:
        return log_k, torch.zeros_like(on), torch.zeros_like(on)
    if sequence_ids is None:
        raise ValueError(f"sequence_ids: required by objective.correction_level {config.correction_level!r}, "
                         f"rejection {config.rejection!r}, veto_threshold {config.veto_threshold!r}")
    m = on.to(torch.float64)
    veto = config.veto_threshold if config.veto_threshold is not None else 0.0
    cols = torch.stack([log_k * m, (log_k.exp() - 1 - log_k) * m, (log_k < math.log(veto) if veto else
                                                                      torch.zeros_like(on)) * m, m], -1)
    S, K3, V, n = per_sequence_sums(cols, sequence_ids, group=group, num_sequences=num_sequences).unbind(-1)
    n = n.clamp_min(1.0)
    level = {"token": log_k.to(torch.float64), "sequence": S, "geometric": S / n}[config.correction_level]
    if config.rejection == "k1":
        rejected = (S / n).abs() > config.rejection_threshold
    elif config.rejection == "k3":
        rejected = K3 / n > config.rejection_threshold
    else:
        rejected = torch.zeros_like(on)
    return level.to(log_k.dtype), rejected, V > 0


def _mismatch_weight(config: ObjectiveConfig, log_k: torch.Tensor) -> torch.Tensor:
    """Correction weight on k = pi_old(k) / mu(k): TIS min(k, C), MIS k 1[k <= C], IcePop k 1[lo <= k <= hi]."""
    k = log_k.exp()
    if config.correction == "tis":
        return k.clamp(max=config.correction_cap)
    if config.correction == "mis":
        return torch.where(k <= config.correction_cap, k, 0.0)
    return torch.where((k >= config.icepop_low) & (k <= config.icepop_high), k, 0.0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) [T] from d = log pi(k) - log pi_ref(k) at the sampled tokens:
    k1 = d, abs = |d|, k2 = d^2 / 2, k3 = low_var_kl = e^-d - 1 + d (d clamped to [-20, 20], the value to
    [-10, 10], as verl's low_var_kl); with "+", the estimator's value and k2's gradient (straight-through:
    E[grad k2] is the gradient of KL(pi || pi_ref) under on-policy sampling, k1's and k3's are not)."""
    d = logprobs - ref_logprobs
    kind = kl_type.rstrip("+")
    if kind == "k1":
        value = d
    elif kind == "abs":
        value = d.abs()
    elif kind == "k2":
        value = 0.5 * d.square()
    else:
        dc = d.clamp(-20.0, 20.0)
        value = ((-dc).exp() - 1 + dc).clamp(-10.0, 10.0)
    if kl_type.endswith("+"):
        k2 = 0.5 * d.square()
        value = k2 - k2.detach() + value.detach()
    return value


def trust_region_mask(config: ObjectiveConfig, stats: PolicyStatistics, log_ratio, advantages) -> TrustRegionMask:
    if config.mask == "ppo":
        return ppo_mask(log_ratio, advantages, eps_low=config.eps_low, eps_high=config.eps_high)
    if config.mask == "dppo":
        return dppo_mask(stats.divergence, log_ratio, advantages, delta=config.delta)
    if config.mask == "pdm":
        return pdm_mask(stats.divergence, stats.predicted_change, advantages, delta=config.delta)
    keep = torch.ones_like(advantages, dtype=torch.bool)
    return TrustRegionMask(keep, ~keep, ~keep)


def policy_loss(
    logits: torch.Tensor,
    behavior: BehaviorTopK | BehaviorLogits,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: ObjectiveConfig,
    *,
    temperature: float,
    normalizer: float | torch.Tensor,
    sequence_ids: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    sequence_lengths: torch.Tensor | None = None,
    token_age: torch.Tensor | None = None,
    anchor: BehaviorTopK | None = None,
    ref_logprobs: torch.Tensor | None = None,
    ref_logits: torch.Tensor | None = None,
    tp_group=None,
    sequence_group=None,
    num_sequences: int | None = None,
) -> PolicyLossOutput:
    """Masked policy-gradient loss for T tokens from the local logits shard [T, V/tp].

    With r = pi(k) / mu(k) (mu the rollout policy, the trust-region anchor; pi = softmax(logits / temperature), at
    mu's sampling temperature: `rollout.temperature` in a run), M the mask of `config.mask`:
      loss "dppo":  l_t = -M_t w_t sg(min(rho_t, C)) A_t log pi_t(k)
      loss "ppo":   l_t = -M_t w_t min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t), and for A_t < 0
                    at most -C A_t (dual clip); rho carries the gradient
    where rho = r and w = 1 without a mismatch correction, and rho = pi / pi_old, w = correction(pi_old / mu) with
    one (`old_logprobs` = log pi_old(k), the training policy before this step's first update). The correction's
    argument follows `correction_level` (`sequence_corrections`: per token, or the sequence's product or geometric
    mean), and a sequence rejected or vetoed on its mismatch gets M = 0 on all its tokens. A sequence split over
    calls (context parallelism) sums over `sequence_group` (its rows: `num_sequences`).
    Then, on every loss token whatever the mask (not in a rejected or vetoed sequence), l_t += kl_coef u_t kl_t -
    entropy_coef H_t: kl_t the
    `kl_type` estimate of KL(pi || pi_ref) from `ref_logprobs` = log pi_ref(k) (`kl_penalty`), or for kl_type exact
    KL(pi || pi_ref) itself over the whole vocabulary from `ref_logits`, pi_ref's shard [T, V/tp] of this layout
    (`kl_to_reference`, with its gradient), u_t = 1, or
    sg(min(r_t, C)) with kl_unbiased (tokens sampled from mu); H_t the exact entropy of pi (vocab-parallel, with its
    gradient dH/dz_i = -(pi_i / T)(log pi_i + H)).
    Aggregated: loss = sum_t c_t l_t / normalizer (1 for a normalizer of 0: no loss token gives 0, never NaN),
    c_t = loss_mask_t (token_mean, seq_mean_token_sum) or
    loss_mask_t / |sequence of t| (seq_mean_token_mean), where |sequence of t| counts the loss tokens of t's sequence
    among these T tokens, or is `sequence_lengths`_t when given (a sequence split over calls: context parallelism).

    token_age [T] (the versions between each token's weights and the trainer's) only splits the diagnostics by age.
    anchor (objective.anchor proximal): the trust region's centre instead of mu, a top-K view on mu's ids (pi_old's
    log-probs there): D, Ddot and the mask's ratio test are taken against it; the loss's ratio and weight, and the
    mismatch diagnostics, stay against mu (and pi_old with a correction).

    Per micro-batch this reads nothing back to the host: `behavior`, advantages, loss_mask, sequence_ids and
    old_logprobs must be on the logits' device (checked, without reading values) and already validated
    (`behavior.validate(V)` where it is built; finite advantages). The loss is finite for finite logits and a
    valid behavior, including log mu = -inf (probability 0): the ppo loss clamps log rho at
    log(2 max(C, 1 + eps_high)), beyond which its surrogate is flat in rho (same value, zero gradient).
    """
    T, device = logits.shape[0], logits.device
    _check_loss_inputs(config, T, device, advantages, loss_mask, sequence_ids, old_logprobs, sequence_lengths,
                       token_age, ref_logprobs, ref_logits)
    stats = policy_statistics(
        logits, behavior if anchor is None else anchor, config.divergence, tail=config.tail, group=tp_group,
        temperature=temperature, entropy_grad=config.entropy_coef > 0
    )
    kl_ref = kl_to_reference(logits, ref_logits, group=tp_group, temperature=temperature) \
        if config.kl_coef and config.kl_type == "exact" else None
    mu = _behavior_token_logprobs(stats.behavior_logprobs, behavior, anchor, stats.logprobs.dtype)
    parts = _sequence_parts(config, mu, advantages, loss_mask, sequence_ids, old_logprobs, sequence_lengths,
                            normalizer, sequence_group, num_sequences, stats.logprobs.dtype)
    terms = _token_terms(config, stats, mu, anchor is not None, parts, slice(None), kl_ref, ref_logprobs)
    loss = (terms.per_token * parts.weights).sum() / parts.normalizer
    return _output(config, loss, terms, stats, parts, loss_mask, token_age)


def policy_loss_from_hidden(
    hidden: torch.Tensor,
    output_weight: torch.Tensor,
    behavior: BehaviorTopK | BehaviorLogits,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: ObjectiveConfig,
    *,
    temperature: float,
    normalizer: float | torch.Tensor,
    sequence_ids: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    sequence_lengths: torch.Tensor | None = None,
    token_age: torch.Tensor | None = None,
    anchor: BehaviorTopK | None = None,
    ref_logprobs: torch.Tensor | None = None,
    ref_hidden: torch.Tensor | None = None,
    ref_output_weight: torch.Tensor | None = None,
    tp_group=None,
    sequence_group=None,
    num_sequences: int | None = None,
    chunk_rows: int | None = None,
) -> PolicyLossOutput:
    """`policy_loss` of the logits hidden @ output_weight^T, fused with the output layer: the same loss, gradients
    and metrics without the [T, V/tp] logits (`vocab_parallel.fused_output_loss`: chunks of `chunk_rows` rows, the
    gradient taken in the forward from each chunk's logits).

    hidden [T, H]: what the output layer reads at the loss tokens (gathered over TP under sequence parallelism,
    `models.fuse_output_layer`); output_weight [V/tp, H]: its shard (the embedding's when tied). For the exact KL
    to a reference, ref_hidden [T, H] and ref_output_weight (pi_ref's logits are their product) instead of
    ref_logits. Everything else as `policy_loss`; `stats.logprobs` and `stats.entropy` come back detached.
    """
    T, device = hidden.shape[0], hidden.device
    exact_kl = bool(config.kl_coef) and config.kl_type == "exact"
    if exact_kl and (ref_hidden is None or ref_output_weight is None):
        raise ValueError(f"ref_hidden, ref_output_weight: required by objective.kl_coef = {config.kl_coef!r} with "
                         "kl_type 'exact'")
    _check_loss_inputs(config, T, device, advantages, loss_mask, sequence_ids, old_logprobs, sequence_lengths,
                       token_age, ref_logprobs, ref_hidden if exact_kl else None)
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    # log mu(k) of every token before the first chunk, for the sequence-level parts (exact kinds: one pass over
    # mu's shard, only when a correction needs it; otherwise each chunk's statistics carry it)
    mu = None
    if isinstance(behavior, BehaviorTopK):
        mu = _behavior_token_logprobs(behavior.token_logprobs.to(dtype).clamp(max=0.0), behavior, anchor, dtype)
    elif old_logprobs is not None and (config.correction != "none" or config.rejects):
        mu = token_logprobs(behavior.logits, behavior.token_ids, group=tp_group, temperature=temperature)
    parts = _sequence_parts(config, mu, advantages, loss_mask, sequence_ids, old_logprobs, sequence_lengths,
                            normalizer, sequence_group, num_sequences, dtype)

    def chunk_loss(rows, stats, kl_ref):
        mu_rows = mu[rows] if mu is not None else stats.behavior_logprobs
        terms = _token_terms(config, stats, mu_rows, anchor is not None, parts, rows, kl_ref,
                             None if ref_logprobs is None else ref_logprobs[rows])
        loss = (terms.per_token * parts.weights[rows]).sum() / parts.normalizer
        return loss, terms._replace(per_token=terms.per_token.detach(),
                                    kl=None if terms.kl is None else terms.kl.detach())

    out = fused_output_loss(hidden, output_weight, chunk_loss, behavior=behavior if anchor is None else anchor,
                            kind=config.divergence, tail=config.tail, group=tp_group, temperature=temperature,
                            reference=(ref_hidden, ref_output_weight) if exact_kl else None, chunk_rows=chunk_rows)
    terms = _TokenTerms(*(_cat_rows([getattr(t, f) for t in out.extras]) for f in _TokenTerms._fields))
    stats = out.stats if mu is None or anchor is not None else out.stats._replace(behavior_logprobs=mu)
    return _output(config, out.loss, terms, stats, parts, loss_mask, token_age)


def _cat_rows(values: list):
    """The chunks' [rows] values of one field, concatenated ([T]; a TrustRegionMask field by field)."""
    if values[0] is None:
        return None
    if isinstance(values[0], TrustRegionMask):
        return TrustRegionMask(*(torch.cat(f) for f in zip(*values, strict=True)))
    return torch.cat(values)


def _check_loss_inputs(config, T, device, advantages, loss_mask, sequence_ids, old_logprobs, sequence_lengths,
                       token_age, ref_logprobs, ref_logits):
    for name, t in (("advantages", advantages), ("loss_mask", loss_mask), ("sequence_ids", sequence_ids),
                    ("old_logprobs", old_logprobs), ("sequence_lengths", sequence_lengths), ("token_age", token_age)):
        if t is not None:
            _check_per_token(name, t, T, device)
    if config.correction != "none" and old_logprobs is None:
        raise ValueError(f"old_logprobs: required by objective.correction = {config.correction!r}")
    if config.rejects and old_logprobs is None:
        raise ValueError(f"old_logprobs: required by objective.rejection = {config.rejection!r} / veto_threshold = "
                         f"{config.veto_threshold!r}")
    exact_kl = config.kl_coef and config.kl_type == "exact"
    if config.kl_coef and (ref_logits if exact_kl else ref_logprobs) is None:
        raise ValueError(f"{'ref_logits' if exact_kl else 'ref_logprobs'}: required by objective.kl_coef = "
                         f"{config.kl_coef!r} with kl_type {config.kl_type!r}")
    if ref_logprobs is not None:
        _check_per_token("ref_logprobs", ref_logprobs, T, device)


def _behavior_token_logprobs(stats_mu, behavior, anchor, dtype):
    """log mu(k) for the loss's ratio: the statistics' (the engine's, clamped at 0; from mu's shard for the exact
    kinds), or with a proximal anchor (the statistics are then pi_old's) the engine's as sent."""
    return stats_mu if anchor is None else behavior.token_logprobs.to(dtype)


class _SequenceParts(NamedTuple):
    """The per-token factors of the loss that do not depend on pi: [T] each (or scalars)."""

    advantages: torch.Tensor
    on: torch.Tensor  # loss_mask > 0
    base: torch.Tensor | None  # log pi_old(k) under a correction (rho = pi / pi_old), else None (rho = pi / mu)
    weight: torch.Tensor | float  # the correction's weight w
    kept: torch.Tensor | float  # 0 on the tokens of a rejected or vetoed sequence
    weights: torch.Tensor  # aggregation weights c_t
    normalizer: torch.Tensor | float
    log_w: torch.Tensor | None  # for the metrics: the correction's log K, and the sequences dropped
    rejected: torch.Tensor | None
    vetoed: torch.Tensor | None


def _sequence_parts(config, mu, advantages, loss_mask, sequence_ids, old_logprobs, sequence_lengths, normalizer,
                    sequence_group, num_sequences, dtype) -> _SequenceParts:
    on = loss_mask > 0
    base, w, kept, log_w, rejected, vetoed = None, 1.0, 1.0, None, None, None
    with torch.no_grad():
        if old_logprobs is not None and (config.correction != "none" or config.rejects):
            log_w, rejected, vetoed = sequence_corrections(
                config, old_logprobs.to(dtype) - mu, on, sequence_ids, group=sequence_group,
                num_sequences=num_sequences)
            kept = (~(rejected | vetoed)).to(dtype)  # a rejected sequence leaves every term
            if config.correction != "none":
                base, w = old_logprobs.to(dtype), _mismatch_weight(config, log_w)
    weights = _token_weights(loss_mask, sequence_ids, config.aggregation, sequence_lengths).to(dtype)
    if isinstance(normalizer, torch.Tensor):
        normalizer = normalizer.to(device=loss_mask.device, dtype=dtype)
        normalizer = torch.where(normalizer > 0, normalizer, 1.0)  # no loss token anywhere: 0 / 1, never 0 / 0
    else:
        normalizer = normalizer if normalizer > 0 else 1.0
    return _SequenceParts(advantages.to(dtype), on, base, w, kept, weights, normalizer, log_w, rejected, vetoed)


class _TokenTerms(NamedTuple):
    per_token: torch.Tensor  # [rows] l_t, zero where loss_mask is 0
    mask: TrustRegionMask
    log_ratio: torch.Tensor  # log pi(k) - log mu(k)
    clipped: torch.Tensor
    kl: torch.Tensor | None  # the KL penalty's per-token value


def _rows(x, rows):
    return x[rows] if isinstance(x, torch.Tensor) and x.dim() > 0 else x


def _token_terms(config, stats: PolicyStatistics, mu, anchored: bool, parts: _SequenceParts, rows, kl_ref,
                 ref_logprobs) -> _TokenTerms:
    """The per-token loss l_t of `policy_loss` on `rows`, from the statistics of those rows (differentiable through
    stats.logprobs, stats.entropy and kl_ref) and the sequence-level parts."""
    logp = stats.logprobs
    adv, on, w, kept = (_rows(x, rows) for x in (parts.advantages, parts.on, parts.weight, parts.kept))
    base = mu if parts.base is None else parts.base[rows]
    with torch.no_grad():
        # log mu(k) = -inf (probability 0) gives the same as SGLang's -3.4e38: a huge finite log-ratio, not inf - inf
        log_ratio = (logp.detach() - mu).clamp(max=torch.finfo(logp.dtype).max)
        centre = (logp.detach() - stats.behavior_logprobs).clamp(max=torch.finfo(logp.dtype).max) if anchored \
            else log_ratio
        mask = trust_region_mask(config, stats, centre, adv)
        coef = mask.keep.to(logp.dtype) * w * kept
    if config.loss == "dppo":
        rho = (logp.detach() - base).exp()
        per_token = -coef * rho.clamp(max=config.ratio_cap) * adv * logp
        clipped = rho > config.ratio_cap
    else:
        rho = (logp - base).clamp(max=math.log(2 * max(config.ratio_cap, 1 + config.eps_high))).exp()
        surrogate = torch.minimum(rho * adv, rho.clamp(1 - config.eps_low, 1 + config.eps_high) * adv)
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, config.ratio_cap * adv), surrogate)
        per_token = -coef * surrogate
        r = rho.detach()
        clipped = ((adv > 0) & (r > 1 + config.eps_high)) | ((adv < 0) & (r < 1 - config.eps_low))
    kl = None
    if config.kl_coef:
        kl = kl_ref.to(logp.dtype) if config.kl_type == "exact" else \
            kl_penalty(logp, ref_logprobs.to(logp.dtype), config.kl_type)
        u = log_ratio.exp().clamp(max=config.ratio_cap) if config.kl_unbiased else 1.0
        per_token = per_token + config.kl_coef * kept * u * kl
    if config.entropy_coef:
        per_token = per_token - config.entropy_coef * kept * stats.entropy
    return _TokenTerms(per_token * on, mask, log_ratio, clipped, kl)


def _output(config, loss, terms: _TokenTerms, stats, parts: _SequenceParts, loss_mask, token_age):
    metrics = diagnostics(stats, terms.mask, terms.log_ratio, parts.advantages, loss_mask, terms.clipped,
                          delta=config.delta, token_age=token_age)
    if config.divergence == "topk_kl":  # D is then the top-K estimate of KL(mu || pi): the mismatch in its terms
        metrics.add_mean("mismatch/kl_topk", stats.divergence, loss_mask > 0)
    if terms.kl is not None:
        metrics.add_mean("policy/kl_ref", terms.kl.detach(), loss_mask > 0)
    if parts.log_w is not None:  # the correction's weight before its cap (log K), and the sequences dropped
        on, log_w = parts.on, parts.log_w
        metrics.add_mean("correction/log_weight_mean", log_w, on)
        metrics.add_quantile("correction/abs_log_weight", log_w.abs(), on, q=0.99)
        metrics.add_max("correction/log_weight_max", log_w, on)
        if config.correction != "none":
            metrics.add_fraction("correction/weight_changed_frac", parts.weight != log_w.exp(), on)  # capped or 0
        if config.rejection != "none":
            metrics.add_fraction("correction/rejected_frac", parts.rejected, on)
        if config.veto_threshold is not None:
            metrics.add_fraction("correction/vetoed_frac", parts.vetoed, on)
    return PolicyLossOutput(loss, terms.per_token.detach(), terms.mask, stats, metrics)


AGE_BUCKETS = ("age0", "age1", "age2", "age3+")


def diagnostics(stats: PolicyStatistics, mask: TrustRegionMask, log_ratio, advantages, loss_mask, clipped, *,
                delta: float, token_age: torch.Tensor | None = None) -> Metrics:
    """What every step logs (DESIGN.md 3.3), as sums and counts over the loss tokens.

    mask/*: the configured mask (outside = its proximity test); divergence/outside_frac: D > delta whatever the
    mask, so runs with different masks compare; direction_disagree: sign(A (r-1)) != sign(A Ddot);
    mismatch/*: r = pi(k) / mu(k): kl_k3 = mean(r - 1 - log r), |log r| mean and p99, fraction of r outside [0.5, 2].
    token_age [N] (versions between each token's weights and the trainer's; off-policy schedules): the mismatch and
    the outside fraction again per age, mismatch/age{0,1,2,3+}/... and divergence/age{...}/outside_frac, so that
    lag is not read as precision.
    """
    m = Metrics()
    on = loss_mask > 0
    moving = on & (advantages != 0)
    ratio_dir = ratio_direction(log_ratio, advantages)
    pred_dir = (torch.sign(advantages) * torch.sign(stats.predicted_change)) > 0
    disagree = ratio_dir != pred_dir
    outside = mask.proximity
    m.add_fraction("mask/outside_frac", outside, on)
    m.add_fraction("mask/masked_frac", ~mask.keep, on)
    m.add_fraction("mask/proximity_only_frac", outside & ~mask.direction, on)
    m.add_fraction("mask/direction_only_frac", mask.direction & ~outside, on)
    m.add_fraction("mask/both_frac", outside & mask.direction, on)
    m.add_fraction("mask/direction_disagree_frac", disagree, moving)
    m.add_fraction("mask/direction_disagree_outside_frac", disagree, moving & outside)
    m.add_fraction("divergence/outside_frac", stats.divergence > delta, on)
    m.add_mean("divergence/mean", stats.divergence, on)
    m.add_max("divergence/max", stats.divergence, on)
    r = log_ratio.exp()
    m.add_mean("mismatch/kl_k3", (r - 1) - log_ratio, on)  # unbiased for KL(mu || pi) under tokens ~ mu
    m.add_mean("mismatch/abs_log_ratio", log_ratio.abs(), on)
    m.add_quantile("mismatch/abs_log_ratio", log_ratio.abs(), on, q=0.99)
    m.add_fraction("mismatch/ratio_outside_0.5_2_frac", (r < 0.5) | (r > 2.0), on)
    m.add_fraction("loss/clipped_ratio_frac", clipped, on)
    m.add_mean("policy/entropy", stats.entropy, on)
    if token_age is not None:
        for i, bucket in enumerate(AGE_BUCKETS):
            at = on & ((token_age >= i) if i == len(AGE_BUCKETS) - 1 else (token_age == i))
            m.add_mean(f"mismatch/{bucket}/kl_k3", (r - 1) - log_ratio, at)
            m.add_mean(f"mismatch/{bucket}/abs_log_ratio", log_ratio.abs(), at)
            m.add_fraction(f"divergence/{bucket}/outside_frac", stats.divergence > delta, at)
    return m
