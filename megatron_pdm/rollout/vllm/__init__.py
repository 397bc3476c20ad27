"""A stub vLLM engine: registered, configured and built like any engine, refusing to start."""

from __future__ import annotations

from ..spec import EngineSpec
from .config import VLLMConfig


class VLLMEngine:
    """A `RolloutEngine` that refuses to start."""

    def __init__(self, rollout):
        self.urls, self.weight_version = rollout.vllm.urls, -1

    def start(self) -> None:
        raise RuntimeError(f"rollout.engine: 'vllm' is a stub; no workers at {list(self.urls)} are used")


def build(rollout, model_cfg, precision_cfg, *, dtype, quantization, run_dir, tokenizer_dir):
    return VLLMEngine(rollout)


SPEC = EngineSpec(name="vllm", build=build, config=VLLMConfig)
