"""Compatibility patches for running megatron-core where its CUDA assumptions do not hold (CPU + gloo).

Everything that patches third-party code lives here, each patch documented in `cpu.py`, applied only when
CUDA is absent (`apply_cpu_patches()` is a no-op on a GPU machine; `patch_mla_without_te` wherever TE is absent,
`patch_mla_q_projection` and `patch_expert_bias_padding` everywhere: megatron-core bugs; `lowp_gemm_scope` around
compute, for a bf16 / fp16 the CPU has no native GEMM for) and covered by tests/test_compat.py and
tests/test_lowp_gemm.py.
"""

from .cpu import (
    apply_cpu_patches,
    cpu_patches_applied,
    cuda_to_cpu_scope,
    lowp_gemm_emulated,
    lowp_gemm_scope,
    patch_expert_bias_padding,
    patch_mla_q_projection,
    patch_mla_without_te,
)

__all__ = [
    "apply_cpu_patches",
    "cpu_patches_applied",
    "cuda_to_cpu_scope",
    "lowp_gemm_emulated",
    "lowp_gemm_scope",
    "patch_expert_bias_padding",
    "patch_mla_q_projection",
    "patch_mla_without_te",
]
