"""On-policy distillation terms (DESIGN.md 2.5b): the per-token divergence to a teacher as a loss term and as a
per-token reward added to the advantages. Pure functions on tensors; the teacher's logits shard or top-K comes from
the caller (an in-trainer teacher's forward, or an engine's `score`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_pdm._dataclass import from_dict
from megatron_pdm._validate import check_bool, check_choice, check_int, check_number
from megatron_pdm.vocab_parallel import DISTILL_KINDS, BehaviorTopK, distill_divergence, distill_divergence_topk

from .loss import _token_weights
from .metrics import Metrics


@dataclass(frozen=True)
class DistillObjective:
    """The distillation part of the objective.

    kind         reverse: KL(pi || t) (mode-seeking, the OPD default of slime / Thinking Machines), forward:
                 KL(t || pi), jsd: the generalized JSD with mixture weight beta (TRL's GKD)
    beta         the JSD's teacher weight in m = beta t + (1 - beta) pi; 0 is forward, 1 reverse
    coef         the loss term coef x D_t per loss token (aggregated like the policy loss); 0 = off
    as_reward    add reward_coef x (log t(y_t) - log mu(y_t)) to each loss token's advantage: the sampled-token
                 estimate of -KL(mu || t) (mu the policy that sampled y), not normalised or whitened
    reward_coef  its weight
    top_k        the teacher's top-K log-probs asked of an engine teacher (the top-K divergence); 0: the exact
                 divergence against an in-trainer teacher's logits shard
    """

    kind: str = "reverse"
    beta: float = 0.5
    coef: float = 1.0
    as_reward: bool = False
    reward_coef: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        check_choice("distill.kind", self.kind, DISTILL_KINDS)
        check_number("distill.beta", self.beta, lo=0.0, hi=1.0)
        check_number("distill.coef", self.coef, lo=0.0, finite=True)
        check_bool("distill.as_reward", self.as_reward)
        check_number("distill.reward_coef", self.reward_coef, lo=0.0, finite=True)
        check_int("distill.top_k", self.top_k, lo=0)
        if not self.coef and not self.as_reward:
            raise ValueError("distill.coef: 0 and distill.as_reward false: the teacher would change nothing")

    @classmethod
    def from_dict(cls, d: dict) -> DistillObjective:
        return from_dict(cls, d, "distill")


def distill_token_divergence(config: DistillObjective, logits: torch.Tensor, *, teacher_logits=None,
                             teacher_topk: BehaviorTopK | None = None, temperature: float = 1.0,
                             tp_group=None) -> torch.Tensor:
    """D_t [T] of `config.kind`, differentiable in the logits shard [T, V/tp]: exact against the teacher's logits
    shard of the same layout (`distill_divergence`), or top-K against the teacher's top-K view
    (`distill_divergence_topk`), whichever is given."""
    if (teacher_logits is None) == (teacher_topk is None):
        raise ValueError("teacher_logits, teacher_topk: give exactly one (an in-trainer or an engine teacher)")
    if teacher_logits is not None:
        return distill_divergence(logits, teacher_logits, config.kind, beta=config.beta, group=tp_group,
                                  temperature=temperature)
    return distill_divergence_topk(logits, teacher_topk, config.kind, beta=config.beta, group=tp_group,
                                   temperature=temperature)


def distill_weights(config: DistillObjective, loss_mask: torch.Tensor, *, aggregation: str, normalizer,
                    sequence_ids=None, sequence_lengths=None, dtype=torch.float32) -> torch.Tensor:
    """coef x c_t / normalizer per token [T]: c_t the policy loss's aggregation weights (`loss._token_weights`), the
    normaliser its global one (0 counts as 1: no loss token gives 0, never NaN)."""
    w = _token_weights(loss_mask, sequence_ids, aggregation, sequence_lengths).to(dtype)
    n = torch.as_tensor(normalizer, dtype=dtype, device=loss_mask.device)
    return config.coef * w / torch.where(n > 0, n, 1.0)


def distill_loss(config: DistillObjective, divergence: torch.Tensor, loss_mask: torch.Tensor, *, aggregation: str,
                 normalizer, sequence_ids=None, sequence_lengths=None) -> tuple[torch.Tensor, Metrics]:
    """(sum_t coef c_t D_t / normalizer, metrics distill/kl) with `distill_weights`, so that the term sums over
    micro-batches and DP ranks to coef x the aggregated divergence. Not masked by the trust region (DESIGN.md
    2.6)."""
    w = distill_weights(config, loss_mask, aggregation=aggregation, normalizer=normalizer, sequence_ids=sequence_ids,
                        sequence_lengths=sequence_lengths, dtype=divergence.dtype)
    loss = (w * divergence).sum()
    metrics = Metrics()
    metrics.add_mean("distill/kl", divergence.detach(), loss_mask > 0)
    return loss, metrics


def distill_advantages(config: DistillObjective, advantages: torch.Tensor, teacher_logprobs: torch.Tensor,
                       behavior_logprobs: torch.Tensor) -> torch.Tensor:
    """A_t + reward_coef (log t(y_t) - log mu(y_t)) per token (as_reward), else A_t unchanged: the sampled-token
    estimate of -KL(mu || t) at t, whose expectation over y_t ~ mu is -KL(mu_t || t_t); mu's log-probs are the
    engine's (the policy that sampled y). Per token, no discount over later tokens, no group normalisation: the
    per-token reverse-KL reward of slime / Thinking Machines' OPD. The log-probs clamp at -1e4 (an engine's
    -inf or finfo.min would make the advantage non-finite)."""
    if not config.as_reward:
        return advantages
    gap = teacher_logprobs.to(advantages.dtype).clamp_min(-1e4) - behavior_logprobs.to(advantages.dtype).clamp_min(-1e4)
    return advantages + config.reward_coef * gap
