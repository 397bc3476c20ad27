"""Compatibility patches for running megatron-core where its CUDA assumptions do not hold (CPU + gloo).

Everything that patches third-party code lives here, each patch documented in `cpu.py`, applied only when
CUDA is absent (`apply_cpu_patches()` is a no-op on a GPU machine; `patch_mla_without_te` wherever TE is absent,
`patch_expert_bias_padding` everywhere: a megatron-core bug) and covered by tests/test_compat.py.
"""

from .cpu import (
    apply_cpu_patches,
    cpu_patches_applied,
    cuda_to_cpu_scope,
    patch_expert_bias_padding,
    patch_mla_without_te,
)

__all__ = [
    "apply_cpu_patches",
    "cpu_patches_applied",
    "cuda_to_cpu_scope",
    "patch_expert_bias_padding",
    "patch_mla_without_te",
]
