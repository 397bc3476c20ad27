"""Trust-region masks (PPO, DPPO, PDM), the policy loss, advantages and diagnostics.

The function-level entry point for other trainers (verl, slime, NeMo-RL) is `policy_loss`: pass your logits
shard [T, V/tp], your tensor-parallel group and the rollout engine's top-K view (`BehaviorTopK`).
"""

from .advantages import (
    broadcast_to_tokens,
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
)
from .analysis import alignment_rates
from .config import DEFAULT_DELTA, ObjectiveConfig
from .distill import (
    DistillObjective,
    distill_advantages,
    distill_loss,
    distill_token_divergence,
    distill_weights,
)
from .loss import (
    PolicyLossOutput,
    diagnostics,
    kl_penalty,
    loss_normalizer,
    policy_loss,
    policy_loss_from_hidden,
    trust_region_mask,
)
from .masks import TrustRegionMask, dppo_mask, pdm_mask, ppo_mask, ratio_direction
from .metrics import Metrics

__all__ = [
    "DEFAULT_DELTA",
    "DistillObjective",
    "Metrics",
    "ObjectiveConfig",
    "PolicyLossOutput",
    "TrustRegionMask",
    "alignment_rates",
    "broadcast_to_tokens",
    "compute_advantages",
    "diagnostics",
    "distill_advantages",
    "distill_loss",
    "distill_token_divergence",
    "distill_weights",
    "dppo_mask",
    "dr_grpo_advantages",
    "grpo_advantages",
    "kl_penalty",
    "loss_normalizer",
    "pdm_mask",
    "policy_loss",
    "policy_loss_from_hidden",
    "ppo_mask",
    "ratio_direction",
    "rloo_advantages",
    "trust_region_mask",
]
