"""The `RolloutEngine` protocol: what the trainer needs from any rollout engine (embedded, SGLang)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from megatron_pdm._validate import check_int, check_number
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
        check_int("sampling.max_new_tokens", self.max_new_tokens)
        check_int("sampling.n", self.n)
        check_number("sampling.temperature", self.temperature, lo=0, lo_open=True, finite=True)
        check_int("sampling.top_k_logprobs", self.top_k_logprobs)
        check_number("sampling.top_p", self.top_p, lo=0, hi=1, lo_open=True)
        check_int("sampling.top_k", self.top_k, special=-1, special_note="no truncation")

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


Weights = Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]]


def weight_buckets(weights: Weights) -> Iterator[Mapping[str, torch.Tensor]]:
    """A full state dict as one bucket; an iterable of buckets (a weight sync's stream) as it comes. A consumer
    takes each bucket before asking for the next, and keeps no reference to it then (the stream may reuse it)."""
    if isinstance(weights, Mapping):
        yield weights
    else:
        yield from weights


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer calls; the only seam between the RL loop and an engine (embedded, SGLang). Methods that
    mean nothing for an engine are no-ops there."""

    weight_version: int

    def start(self) -> None:
        """Get ready to take weights: attached servers are waited for and probed; engines launched from the first
        weights start at the first `update_weights`. Idempotent."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RolloutSample]:
        """params.n samples per prompt, returned prompt by prompt (the n samples of prompt i are contiguous)."""

    def update_weights(self, weights: Weights, version: int) -> None:
        """Load the HF-layout weights, a full state dict or an iterable of buckets (dicts) that together hold every
        weight once, consumed one at a time and never all held; rollouts after this carry `version`."""

    def release_memory(self) -> None:
        """Free the engine's memory while the trainer uses the device (colocated engines); the next
        `update_weights` takes it back."""

    def resume_memory(self) -> None:
        """Take the memory back (a no-op unless released)."""

    def health(self) -> bool: ...

    def close(self) -> None: ...
