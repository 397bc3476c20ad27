"""`ObjectiveConfig`: the trust-region mask, the policy loss and its aggregation, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pdm._dataclass import from_dict
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


def _choice(name, value, options):
    if value not in options:
        raise ValueError(f"objective.{name}: {value!r} is not one of {', '.join(options)}")


def _range(name, value, lo=None, hi=None, lo_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"objective.{name}: expected a number, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ValueError(f"objective.{name}: {value!r} must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and value > hi:
        raise ValueError(f"objective.{name}: {value!r} must be <= {hi}")


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
    temperature: float = 1.0

    def __post_init__(self):
        _choice("mask", self.mask, MASKS)
        _choice("divergence", self.divergence, KINDS)
        _choice("tail", self.tail, TAILS)
        _choice("loss", self.loss, LOSSES)
        _choice("aggregation", self.aggregation, AGGREGATIONS)
        _choice("correction", self.correction, CORRECTIONS)
        _choice("advantage", self.advantage, ADVANTAGES)
        if self.delta is None:
            object.__setattr__(self, "delta", DEFAULT_DELTA[self.divergence])
        _range("delta", self.delta, lo=0.0, lo_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"objective.top_k: expected an integer >= 1, got {self.top_k!r}")
        _range("eps_low", self.eps_low, lo=0.0, hi=1.0)
        _range("eps_high", self.eps_high, lo=0.0)
        _range("ratio_cap", self.ratio_cap, lo=1.0)
        _range("correction_cap", self.correction_cap, lo=1.0)
        _range("icepop_low", self.icepop_low, lo=0.0)
        _range("icepop_high", self.icepop_high, lo=self.icepop_low, lo_open=True)
        _range("advantage_std_eps", self.advantage_std_eps, lo=0.0)
        _range("temperature", self.temperature, lo=0.0, lo_open=True)

    @property
    def needs_behavior_logits(self) -> bool:
        return self.mask in ("dppo", "pdm") and self.divergence in EXACT_KINDS

    @classmethod
    def from_dict(cls, d: dict) -> ObjectiveConfig:
        return from_dict(cls, d, "objective")
