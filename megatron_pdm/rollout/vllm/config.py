"""`VLLMConfig`: the `rollout.vllm` sub-section (a stub engine: where its workers would be)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VLLMConfig:
    """The vLLM workers at `urls` (the stub refuses to start)."""

    urls: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "urls", tuple(self.urls))
