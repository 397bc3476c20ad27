"""`ObjectiveConfig`: the trust-region mask, the policy loss and its aggregation, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pdm._dataclass import from_dict
from megatron_pdm._validate import check_choice, check_int, check_number
from megatron_pdm.vocab_parallel import EXACT_KINDS, KINDS, TAILS

MASKS = ("ppo", "dppo", "pdm", "none")
LOSSES = ("dppo", "ppo")
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
CORRECTIONS = ("none", "tis", "mis", "icepop")
ADVANTAGES = ("grpo", "dr_grpo", "rloo")

# DPPO (arXiv 2602.04879) thresholds per divergence; PDM uses the same (paper: top-K KL, delta = 0.15).
DEFAULT_DELTA = {
    "binary_tv": 0.15,
    "binary_kl": 0.05,
    "topk_kl": 0.15,
    "topk_tv": 0.2,
    "kl": 0.15,
    "reverse_kl": 0.15,
    "tv": 0.15,
}


@dataclass(frozen=True)
class ObjectiveConfig:
    """Mask, loss and advantage settings (DESIGN.md section 3). Defaults: PDM on top-K KL, K = 20, delta = 0.15.

    mask         ppo (clip-higher on r), dppo (D > delta and sign(A (r-1)) > 0), pdm (D > delta and
                 sign(A Ddot) > 0), none
    divergence   D for dppo/pdm: binary_tv, binary_kl, topk_kl, topk_tv, or the exact kl, reverse_kl, tv
                 (these need the behavior policy's logits)
    delta        trust-region radius on D; None takes DEFAULT_DELTA[divergence]
    tail         Ddot's top-K tail model: aggregated, uniform, proportional
    top_k        K log-probs asked of the rollout engine
    eps_low/high PPO clip range [1 - eps_low, 1 + eps_high]
    loss         dppo: -M sg(min(r, C)) A log pi(k); ppo: -M min(r A, clip(r) A), dual-clipped at C for A < 0
    ratio_cap    C
    aggregation  token_mean, seq_mean_token_sum, seq_mean_token_mean (over the global batch)
    correction   training-inference mismatch weight on k = pi_old / mu: tis min(k, C_c), mis k 1[k <= C_c],
                 icepop k 1[lo <= k <= hi]; with a correction the loss ratio becomes pi / pi_old
    advantage    grpo (group mean and std), dr_grpo (group mean only), rloo (leave-one-out mean)

    The temperature T of pi = softmax(z / T) is not an objective setting: it is the behavior policy's sampling
    temperature (`rollout.temperature` in a run), which `policy_loss(..., temperature=T)` takes.
    """

    mask: str = "pdm"
    divergence: str = "topk_kl"
    delta: float | None = None
    tail: str = "aggregated"
    top_k: int = 20
    eps_low: float = 0.2
    eps_high: float = 0.28
    loss: str = "dppo"
    ratio_cap: float = 5.0
    aggregation: str = "token_mean"
    correction: str = "none"
    correction_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    advantage: str = "grpo"
    advantage_std_eps: float = 1e-6

    def __post_init__(self):
        check_choice("objective.mask", self.mask, MASKS)
        check_choice("objective.divergence", self.divergence, KINDS)
        check_choice("objective.tail", self.tail, TAILS)
        check_choice("objective.loss", self.loss, LOSSES)
        check_choice("objective.aggregation", self.aggregation, AGGREGATIONS)
        check_choice("objective.correction", self.correction, CORRECTIONS)
        check_choice("objective.advantage", self.advantage, ADVANTAGES)
        if self.delta is None:
            object.__setattr__(self, "delta", DEFAULT_DELTA[self.divergence])
        check_number("objective.delta", self.delta, lo=0.0, lo_open=True)
        check_int("objective.top_k", self.top_k)
        check_number("objective.eps_low", self.eps_low, lo=0.0, hi=1.0)
        check_number("objective.eps_high", self.eps_high, lo=0.0)
        check_number("objective.ratio_cap", self.ratio_cap, lo=1.0)
        check_number("objective.correction_cap", self.correction_cap, lo=1.0)
        check_number("objective.icepop_low", self.icepop_low, lo=0.0)
        check_number("objective.icepop_high", self.icepop_high, lo=self.icepop_low, lo_open=True)
        check_number("objective.advantage_std_eps", self.advantage_std_eps, lo=0.0)

    @property
    def needs_behavior_logits(self) -> bool:
        return self.mask in ("dppo", "pdm") and self.divergence in EXACT_KINDS

    @classmethod
    def from_dict(cls, d: dict) -> ObjectiveConfig:
        return from_dict(cls, d, "objective")
