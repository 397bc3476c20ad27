"""megatron-pdm: predictive divergence masks for trust-region RL on megatron-core."""

__version__ = "0.1.0"
