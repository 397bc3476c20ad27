"""Trust-region masks as `proximity AND direction` (DESIGN.md section 3). A masked token contributes no gradient.

All inputs are per-token [T] tensors; `log_ratio` = log pi(k) - log mu(k), so r = exp(log_ratio).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TrustRegionMask(NamedTuple):
    """keep = ~(proximity & direction); proximity: outside the trust region; direction: the update moves away."""

    keep: torch.Tensor
    proximity: torch.Tensor
    direction: torch.Tensor


def _mask(proximity, direction) -> TrustRegionMask:
    return TrustRegionMask(~(proximity & direction), proximity, direction)


def ratio_direction(log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """sign(A (r - 1)) > 0: the sampled-token update pushes r further from 1."""
    return (torch.sign(advantages) * torch.sign(log_ratio)) > 0


def ppo_mask(log_ratio, advantages, *, eps_low: float, eps_high: float) -> TrustRegionMask:
    """PPO / GRPO clip-higher: masked iff (A > 0 and r > 1 + eps_high) or (A < 0 and r < 1 - eps_low).

    proximity = r outside [1 - eps_low, 1 + eps_high] (the boundaries are inside), direction = sign(A (r-1)) > 0.
    """
    r = log_ratio.double().exp()  # the boundaries are compared in float64
    proximity = (r > 1.0 + eps_high) | (r < 1.0 - eps_low)
    return _mask(proximity, ratio_direction(log_ratio, advantages))


def dppo_mask(divergence, log_ratio, advantages, *, delta: float) -> TrustRegionMask:
    """DPPO: masked iff D > delta and sign(A (r - 1)) > 0."""
    return _mask(divergence > delta, ratio_direction(log_ratio, advantages))


def pdm_mask(divergence, predicted_change, advantages, *, delta: float) -> TrustRegionMask:
    """PDM: masked iff D > delta and sign(A Ddot) > 0, Ddot the predicted change of the same D under the next
    policy-gradient step (`predicted_change` = Ddot / A from `megatron_pdm.vocab_parallel`)."""
    direction = (torch.sign(advantages) * torch.sign(predicted_change)) > 0
    return _mask(divergence > delta, direction)
