"""Rollout engines behind one protocol: the embedded CPU engine (default) and SGLang, built by `build_engine`."""

from .base import RolloutEngine, RolloutSample, SamplingParams, TeacherScores, weight_buckets
from .embedded import EmbeddedEngine
from .factory import build_engine

__all__ = [
    "EmbeddedEngine", "RolloutEngine", "RolloutSample", "SamplingParams", "TeacherScores", "build_engine",
    "weight_buckets",
]
