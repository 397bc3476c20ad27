"""Rollout engines behind one protocol: the embedded CPU engine (default) and, later, SGLang."""

from .base import RolloutEngine, RolloutSample, SamplingParams
from .embedded import EmbeddedEngine

__all__ = ["EmbeddedEngine", "RolloutEngine", "RolloutSample", "SamplingParams"]
