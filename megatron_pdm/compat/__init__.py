"""Compatibility patches for running megatron-core where its CUDA assumptions do not hold (CPU + gloo).

Everything that patches third-party code lives here, each patch documented in `cpu.py`, applied only when
CUDA is absent (`apply_cpu_patches()` is a no-op on a GPU machine) and covered by tests/test_compat.py.
"""

from .cpu import apply_cpu_patches, cpu_patches_applied, cuda_to_cpu_scope

__all__ = ["apply_cpu_patches", "cpu_patches_applied", "cuda_to_cpu_scope"]
