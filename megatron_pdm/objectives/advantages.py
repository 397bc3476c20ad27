"""Group-relative advantages for verifiable-reward RL (one scalar per sequence, broadcast to its tokens)."""

from __future__ import annotations

import torch


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected shape [N], got {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size: {group_size} must be >= 1 and divide the {rewards.numel()} rewards")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards: NaN or inf values")
    return rewards.double().view(-1, group_size)


def grpo_advantages(rewards, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: A_i = (R_i - mean_g R) / (std_g R + eps), std unbiased (as verl and TRL); 0 for one-sample groups.

    `rewards` [N] ordered group by group (the n samples of a prompt are contiguous). normalize_std=False gives
    Dr. GRPO's A_i = R_i - mean_g R. Finite rewards give finite advantages (0 for a group of equal rewards, even
    with eps = 0); the rewards are checked here, once per step, which is what lets `policy_loss` skip the check.
    """
    g = _groups(rewards, group_size)
    adv = g - g.mean(-1, keepdim=True)
    if normalize_std and group_size > 1:
        scale = g.std(-1, keepdim=True) + eps
        adv = torch.where(scale > 0, adv / scale.clamp_min(torch.finfo(scale.dtype).tiny), 0.0)  # eps = 0: 0, not 0/0
    # a group of equal rewards: exactly 0. Its float mean need not round back to the reward (7 x 0.785... / 7 is
    # off by an ulp), and with eps = 0 that 1e-17 over a 1e-17 std is O(1)
    adv = torch.where((g == g[:, :1]).all(-1, keepdim=True), 0.0, adv)
    return adv.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def dr_grpo_advantages(rewards, group_size: int) -> torch.Tensor:
    """Dr. GRPO: A_i = R_i - mean_g R (no std normalisation; pair with a length-independent aggregation)."""
    return grpo_advantages(rewards, group_size, normalize_std=False)


def rloo_advantages(rewards, group_size: int) -> torch.Tensor:
    """RLOO: A_i = R_i - mean_{j != i} R_j = n / (n - 1) (R_i - mean_g R); 0 for one-sample groups."""
    g = _groups(rewards, group_size)
    n = group_size
    adv = (g - g.mean(-1, keepdim=True)) * (n / (n - 1) if n > 1 else 0.0)
    return adv.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def compute_advantages(kind: str, rewards, group_size: int, *, eps: float = 1e-6) -> torch.Tensor:
    if kind == "grpo":
        return grpo_advantages(rewards, group_size, eps=eps)
    if kind == "dr_grpo":
        return dr_grpo_advantages(rewards, group_size)
    if kind == "rloo":
        return rloo_advantages(rewards, group_size)
    raise ValueError(f"advantage: unknown estimator {kind!r}; expected grpo, dr_grpo or rloo")


def broadcast_to_tokens(sequence_values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[N] per-sequence values -> [N, L] per-token values, zero outside the response (response_mask [N, L])."""
    if response_mask.dim() != 2 or response_mask.shape[0] != sequence_values.shape[0]:
        raise ValueError(
            f"response_mask: expected shape [{sequence_values.shape[0]}, L], got {tuple(response_mask.shape)}"
        )
    return sequence_values[:, None] * response_mask.to(sequence_values.dtype)
