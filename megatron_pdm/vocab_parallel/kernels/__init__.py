"""Fused GPU kernels for the vocab-parallel statistics (optional: Triton on CUDA).

`core.py` calls them when `fused_available(logits)` holds and keeps its torch path as the reference and the
CPU path; the kernels compute the same function (tests/vocab_parallel/test_kernels.py runs them under Triton's
interpreter on a CPU, benchmarks/gpu_vocab_parallel.py checks and times them on a GPU). Both wrappers take the whole
local shard: their memory is O(T) besides the logits (and the gradient), so no row chunking is needed.
"""

from __future__ import annotations

import importlib.util

import torch

BLOCK = 1024  # columns per step of a row's walk: 2 KiB of bf16 per load, many loads in flight per SM
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused_available(logits: torch.Tensor) -> bool:
    """The kernels run for CUDA logits of a kernel dtype with unit column stride, when Triton is installed."""
    return logits.is_cuda and logits.dtype in DTYPES and logits.stride(-1) == 1 and triton_available()


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def row_partial_sums(logits: torch.Tensor, local_support: torch.Tensor, temperature: float) -> torch.Tensor:
    """[T, 5] float32 (m, S0, R0, R1, R2) of each row of the local shard (triton_stats.py gives the sums);
    local_support [T, J]: support ids minus this shard's first id (ids of other shards fall outside [0, V_l))."""
    from .triton_stats import _row_partial_sums_kernel

    T, V = logits.shape
    out = torch.empty(T, 5, dtype=torch.float32, device=logits.device)
    if T == 0:
        return out
    sup = local_support.to(torch.int64).contiguous()
    J = sup.shape[1]
    _row_partial_sums_kernel[(T,)](logits, logits.stride(0), sup, sup.stride(0), out, V, 1.0 / temperature,
                                   J=J, JP=max(2, _power_of_two_at_least(J)), BLOCK=BLOCK)
    return out


def logprob_grad(logits: torch.Tensor, local_token: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    """d/dz of sum_t g_t log pi_t(k_t) on the local shard: g (onehot(k) - pi) / temperature, in the logits dtype;
    local_token [T]: k minus this shard's first id."""
    from .triton_stats import _logprob_grad_kernel

    T, V = logits.shape
    grad = torch.empty_like(logits)
    if T == 0:
        return grad
    _logprob_grad_kernel[(T,)](logits, logits.stride(0), grad, grad.stride(0), lse.float().contiguous(),
                               grad_out.float().contiguous(), local_token.to(torch.int64).contiguous(), V,
                               1.0 / temperature, BLOCK=BLOCK)
    return grad


def exact_partial_sums(logits: torch.Tensor, behavior_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[T, 10] float32 per-row sums of the two local shards for the full-vocabulary KL kinds (triton_stats.py)."""
    from .triton_stats import _exact_partial_sums_kernel

    T, V = logits.shape
    out = torch.empty(T, 10, dtype=torch.float32, device=logits.device)
    if T:
        _exact_partial_sums_kernel[(T,)](logits, logits.stride(0), behavior_logits, behavior_logits.stride(0), out,
                                         V, 1.0 / temperature, BLOCK=BLOCK)
    return out


def tv_sums(logits: torch.Tensor, behavior_logits: torch.Tensor, lse: torch.Tensor, temperature: float):
    """[T, 4] float32: this shard's sum |pi - mu|, sum s pi^2, sum s pi, sum pi^2 (s = sign(pi - mu)), given
    lse [T, 2], the global log Z of pi and of mu."""
    from .triton_stats import _tv_sums_kernel

    T, V = logits.shape
    out = torch.empty(T, 4, dtype=torch.float32, device=logits.device)
    if T:
        _tv_sums_kernel[(T,)](logits, logits.stride(0), behavior_logits, behavior_logits.stride(0),
                              lse.float().contiguous(), out, V, 1.0 / temperature, BLOCK=BLOCK)
    return out
