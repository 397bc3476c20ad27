"""`ObjectiveConfig`: the trust-region mask, the policy loss and its aggregation, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pdm._dataclass import from_dict
from megatron_pdm._validate import check_bool, check_choice, check_finite, check_int, check_number
from megatron_pdm.vocab_parallel import EXACT_KINDS, KINDS, TAILS

MASKS = ("ppo", "dppo", "pdm", "none")
LOSSES = ("dppo", "ppo")
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
CORRECTIONS = ("none", "tis", "mis", "icepop")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
REJECTIONS = ("none", "k1", "k3")
ADVANTAGES = ("grpo", "dr_grpo", "rloo")
ANCHORS = ("behavior", "proximal")
# the KL-to-reference estimators on d = log pi(k) - log pi_ref(k) (tokens from the rollout): k1 = d, abs = |d|,
# k2 = d^2 / 2, k3 = low_var_kl = e^-d - 1 + d; "+": the estimator's value with k2's gradient (straight-through)
KL_TYPES = ("k1", "abs", "k2", "k3", "low_var_kl", "k1+", "k3+", "low_var_kl+", "exact")

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
    correction_level  what the correction weighs, with k_t = pi_old(k_t) / mu(k_t): token (each token its own
                 k_t), sequence (every token of a sequence the product of its k_t: K = exp(sum_t log k_t)), geometric
                 (K = exp(mean_t log k_t), the per-token geometric mean; NeMo-RL's seq-mask-tis)
    rejection    drop whole sequences whose mismatch estimate exceeds rejection_threshold (their tokens leave the
                 loss; the normaliser keeps them): k1 = |mean_t log k_t|, k3 = mean_t (k_t - 1 - log k_t)
    veto_threshold  drop a whole sequence when any of its tokens has k_t below this (verl's token veto); None: off
    advantage    grpo (group mean and std), dr_grpo (group mean only), rloo (leave-one-out mean)
    anchor       the trust region's centre: behavior (mu, per token: the engine weights that sampled it) or
                 proximal (pi_old, the weights at the step's start, on mu's top-K ids: decoupled PPO's proximal
                 policy; an experiment arm). It moves D, Ddot and the mask's ratio test only; the loss's ratio and
                 weight follow `correction` either way
    kl_coef      the KL penalty to the reference policy pi_ref (the weights RL started from, frozen): the loss
                 adds kl_coef x kl_type's estimate per loss token, outside the mask (the mask gates the policy-gradient
                 term; PDM's predicted direction covers that step only); 0 = off, no reference model is built
    kl_type      k1, abs, k2, k3 (= low_var_kl, clamped as verl does), and k1+ / k3+ / low_var_kl+: the value of the
                 estimator with the gradient of k2 (straight-through; k1's and k3's own gradients are biased);
                 exact: KL(pi || pi_ref) over the whole vocabulary, vocab-parallel, with its gradient (no
                 estimator: the reference's last hidden states are kept per minibatch, its logits shard recomputed
                 per micro-batch)
    kl_unbiased  weight each token's KL term by sg(min(pi / mu, ratio_cap)): the tokens were sampled from mu, not
                 pi (stale or mismatched rollouts)
    ref_offload  keep the reference policy's weights in host memory (pinned), copied to the GPU for its forward pass
                 once per minibatch: its device memory is free the rest of the step, for a host-to-device copy of
                 this rank's weights per minibatch
    entropy_coef the entropy bonus: the loss adds -entropy_coef x H(pi) per loss token (exact over the whole
                 vocabulary, vocab-parallel, with its gradient); 0 = off
    max_token_age  tokens generated by weights more than this many versions older than the trainer's (at the
                 step's start) leave the loss (they stay in the context); None keeps every age (prime-rl's token
                 masking). The age is against the trainer, not the sample's newest segment: under a lag of k, a
                 bound below k drops whole samples

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
    correction_cap: float = 2.0  # C_c of tis and mis
    icepop_low: float = 0.5  # icepop's lo
    icepop_high: float = 5.0  # icepop's hi
    correction_level: str = "token"
    rejection: str = "none"
    rejection_threshold: float = 0.01
    veto_threshold: float | None = None
    advantage: str = "grpo"
    advantage_std_eps: float = 1e-6  # added to the group std of grpo's advantage denominator
    max_token_age: int | None = None
    anchor: str = "behavior"
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    kl_unbiased: bool = False
    ref_offload: bool = False
    entropy_coef: float = 0.0

    def __post_init__(self):
        check_finite("objective", self)
        check_choice("objective.mask", self.mask, MASKS)
        check_choice("objective.divergence", self.divergence, KINDS)
        check_choice("objective.tail", self.tail, TAILS)
        check_choice("objective.loss", self.loss, LOSSES)
        check_choice("objective.aggregation", self.aggregation, AGGREGATIONS)
        check_choice("objective.correction", self.correction, CORRECTIONS)
        check_choice("objective.correction_level", self.correction_level, CORRECTION_LEVELS)
        check_choice("objective.rejection", self.rejection, REJECTIONS)
        if self.correction_level != "token" and self.correction == "none":
            raise ValueError(f"objective.correction_level: {self.correction_level!r} weighs a correction, and "
                             "objective.correction is 'none' (set tis, mis or icepop)")
        check_choice("objective.advantage", self.advantage, ADVANTAGES)
        check_choice("objective.anchor", self.anchor, ANCHORS)
        check_choice("objective.kl_type", self.kl_type, KL_TYPES)
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
        check_number("objective.rejection_threshold", self.rejection_threshold, lo=0.0, lo_open=True, finite=True)
        if self.veto_threshold is not None:
            check_number("objective.veto_threshold", self.veto_threshold, lo=0.0, hi=1.0, lo_open=True, hi_open=True)
        check_number("objective.kl_coef", self.kl_coef, lo=0.0, finite=True)
        check_number("objective.entropy_coef", self.entropy_coef, lo=0.0, finite=True)
        check_bool("objective.kl_unbiased", self.kl_unbiased)
        check_bool("objective.ref_offload", self.ref_offload)
        if self.ref_offload and not self.kl_coef:
            raise ValueError("objective.ref_offload: true offloads the reference policy, which only a KL penalty "
                             "keeps (objective.kl_coef is 0)")
        if self.max_token_age is not None:
            check_int("objective.max_token_age", self.max_token_age, lo=0)

    @property
    def needs_step_start_pass(self) -> bool:
        """Whether each step first computes pi_old with a forward pass (a correction's pi_old, a proximal anchor,
        a rejection's or veto's mismatch)."""
        return self.correction != "none" or self.anchor == "proximal" or self.rejects

    @property
    def rejects(self) -> bool:
        """Whether whole sequences may leave the loss on their mismatch (rejection or a token veto)."""
        return self.rejection != "none" or self.veto_threshold is not None

    @property
    def per_sequence(self) -> bool:
        """Whether the loss sums over each sequence's tokens (a sequence-level correction, rejection, veto)."""
        return self.correction_level != "token" or self.rejects

    @property
    def needs_reference(self) -> bool:
        """Whether the run keeps a frozen reference model and computes log pi_ref(k) each step (the KL penalty)."""
        return self.kl_coef > 0

    @property
    def needs_behavior_logits(self) -> bool:
        return self.mask in ("dppo", "pdm") and self.divergence in EXACT_KINDS

    @classmethod
    def from_dict(cls, d: dict) -> ObjectiveConfig:
        return from_dict(cls, d, "objective")
