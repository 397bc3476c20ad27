"""The `RolloutEngine` protocol: what the trainer needs from any rollout engine (embedded, SGLang)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from megatron_pdm.vocab_parallel import BehaviorTopK


@dataclass(frozen=True)
class SamplingParams:
    """max_new_tokens per response, n samples per prompt, temperature T (log mu = log_softmax(logits / T)),
    top_k_logprobs K per position, stop_token_ids that end a response (kept in it), seed for reproducible sampling.
    top_p / top_k truncate the sampling distribution (1.0 / -1: none). The masks assume the untruncated
    distribution, and engines (SGLang too) return log-probs taken before truncation, so anything else samples
    from a distribution the trainer does not see; engines warn loudly about it. return_routed_experts asks MoE
    engines for the experts each layer routed every token to (routed-expert replay)."""

    max_new_tokens: int = 32
    n: int = 1
    temperature: float = 1.0
    top_k_logprobs: int = 20
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    topk_include_sampled: bool = False  # put the sampled token in the K-th slot when outside the top-K
    top_p: float = 1.0
    top_k: int = -1
    return_routed_experts: bool = False

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens: expected an integer >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"sampling.n: expected an integer >= 1, got {self.n!r}")
        if not (isinstance(self.temperature, (int, float)) and 0 < self.temperature < float("inf")):
            raise ValueError(f"sampling.temperature: must be a finite number > 0, got {self.temperature!r}")
        if isinstance(self.top_k_logprobs, bool) or not isinstance(self.top_k_logprobs, int) or self.top_k_logprobs < 1:
            raise ValueError(f"sampling.top_k_logprobs: expected an integer >= 1, got {self.top_k_logprobs!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"sampling.top_p: must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"sampling.top_k: expected -1 (no truncation) or an integer >= 1, got {self.top_k!r}")

    @property
    def truncated(self) -> bool:
        return self.top_p < 1 or self.top_k != -1


@dataclass
class RolloutSample:
    """One response: per generated position t, the sampled token, log mu(token) and mu's top-K."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: torch.Tensor  # [L] long
    token_logprobs: torch.Tensor  # [L] float32, log softmax(logits / T) at response_ids
    topk_ids: torch.Tensor  # [L, K] long, sorted by descending log-prob
    topk_logprobs: torch.Tensor  # [L, K] float32
    finish_reason: str  # "stop" or "length"
    weight_version: int
    # [len(prompt_ids) + L - 1, layers, top_k] int32: the experts every MoE layer routed each forwarded token to
    # (the last sampled token is never forwarded), when asked for with return_routed_experts
    routed_experts: torch.Tensor | None = None

    def behavior(self) -> BehaviorTopK:
        return BehaviorTopK(self.response_ids, self.token_logprobs, self.topk_ids, self.topk_logprobs)


@runtime_checkable
class RolloutEngine(Protocol):
    weight_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RolloutSample]:
        """params.n samples per prompt, returned prompt by prompt (the n samples of prompt i are contiguous)."""

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load a full HF-layout state dict; rollouts after this carry `version`."""

    def health(self) -> bool: ...

    def close(self) -> None: ...
