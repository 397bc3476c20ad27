"""Vocab-parallel math: log-probs, entropy, divergences and the predicted divergence change across TP shards.

Pure functions on tensors with an explicit process group (`group=None` is one process). Imports only torch.
"""

from . import kernels
from .behavior import BehaviorLogits, BehaviorTopK
from .core import (
    EXACT_KINDS,
    KINDS,
    TAILS,
    TOPK_KINDS,
    PolicyStatistics,
    divergence,
    entropy,
    kl_to_reference,
    policy_statistics,
    predicted_divergence_change,
    support_logprobs,
    token_logprobs,
)
from .distill import DISTILL_KINDS, distill_divergence, distill_divergence_topk
from .fused import FusedOutput, fused_output_loss, output_logprobs

__all__ = [
    "kernels",
    "BehaviorLogits",
    "BehaviorTopK",
    "DISTILL_KINDS",
    "EXACT_KINDS",
    "KINDS",
    "TAILS",
    "TOPK_KINDS",
    "PolicyStatistics",
    "FusedOutput",
    "distill_divergence",
    "distill_divergence_topk",
    "divergence",
    "entropy",
    "fused_output_loss",
    "kl_to_reference",
    "output_logprobs",
    "policy_statistics",
    "predicted_divergence_change",
    "support_logprobs",
    "token_logprobs",
]
