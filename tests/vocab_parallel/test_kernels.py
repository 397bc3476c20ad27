"""The fused Triton kernels (vocab_parallel/kernels) under Triton's interpreter on a CPU, against the float64
reference and the torch path, at TP 1 and 2. The same checks on a GPU, with timings: benchmarks/gpu_vocab_parallel.py.
"""

import os

import pytest
import torch

from megatron_pdm.vocab_parallel import EXACT_KINDS, TOPK_KINDS, kernels, policy_statistics, token_logprobs
from megatron_pdm.vocab_parallel.core import _support_pass, _support_pass_fused
from tests.reference import (
    assert_ddot_close,
    make_case,
    ref_divergence_and_change,
    ref_entropy,
    ref_logpi,
    tv_sign_slack,
)

pytestmark = [
    pytest.mark.skipif(not kernels.triton_available(), reason="needs triton"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                       reason="a CPU runs the kernels only under TRITON_INTERPRET=1 (tests/conftest.py sets it)"),
]
# wider than one kernel block (1024 columns) with a ragged last block: the online max rescales across blocks
WIDTH, T, K = kernels.BLOCK + 77, 9, 5
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5}


def rank_fused_stats(group, case):
    """Every kind (top-K and exact) and the log pi(k) gradient on this rank's shard, the fused kernels forced on."""
    import torch.distributed as dist

    rank, world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    z, topk, exact = case.shard(rank, world)
    original = kernels.fused_available
    kernels.fused_available = lambda logits: logits.dtype in kernels.DTYPES  # the CPU runs them interpreted
    try:
        out = {kind: policy_statistics(z, exact if kind in EXACT_KINDS else topk, kind, group=group,
                                       temperature=case.temperature) for kind in TOPK_KINDS + EXACT_KINDS}
        leaf = z.detach().clone().requires_grad_(True)
        lp = token_logprobs(leaf, topk.token_ids, group=group, temperature=case.temperature)
        (torch.linspace(-1.0, 2.0, lp.shape[0]) * lp).sum().backward()
        out["grad"] = leaf.grad
    finally:
        kernels.fused_available = original
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_statistics_match_the_float64_reference(dist_pools, world, dtype):
    case = make_case(T, WIDTH * world, K, temperature=0.8, dtype=dtype, seed=10 * world + (dtype == torch.bfloat16))
    case.behavior_logits = case.behavior_logits.to(dtype)  # the reference then sees what the kernels see
    results = [rank_fused_stats(None, case)] if world == 1 else dist_pools(world).run(rank_fused_stats,
                                                                                       shared=(case,))
    tol = TOL[dtype]
    logp_ref = ref_logpi(case.logits, case.temperature).gather(1, case.topk.token_ids[:, None]).squeeze(-1)
    for kind in TOPK_KINDS + EXACT_KINDS:
        d_ref, dd_ref = ref_divergence_and_change(case, kind)
        for r in results:
            s = r[kind]
            torch.testing.assert_close(s.divergence.double(), d_ref, atol=tol, rtol=tol, msg=f"D {kind}")
            slack = tv_sign_slack(case.logits, case.topk, kind, temperature=case.temperature,
                                  behavior_logits=case.behavior_logits)  # TV's sign(pi - mu) flips on noise
            assert_ddot_close(s.predicted_change, dd_ref, slack, atol=tol, rtol=tol, msg=f"Ddot {kind}")
            torch.testing.assert_close(s.logprobs.double(), logp_ref, atol=tol, rtol=tol)
            if kind in EXACT_KINDS:
                lm_ref = torch.log_softmax(case.behavior_logits.double() / case.temperature, -1)
                torch.testing.assert_close(s.behavior_logprobs.double(),
                                           lm_ref.gather(1, case.topk.token_ids[:, None]).squeeze(-1), atol=tol,
                                           rtol=tol)
            torch.testing.assert_close(s.entropy.double(), ref_entropy(case.logits, case.temperature),
                                       atol=5 * tol, rtol=tol)
    z = case.logits.double().requires_grad_(True)
    lp = torch.log_softmax(z / case.temperature, -1).gather(1, case.topk.token_ids[:, None]).squeeze(-1)
    (torch.linspace(-1.0, 2.0, T, dtype=torch.float64) * lp).sum().backward()
    grad = torch.cat([r["grad"] for r in results], dim=1)
    assert grad.dtype == dtype
    gtol = 1e-2 if dtype == torch.bfloat16 else tol  # returned in the logits dtype
    torch.testing.assert_close(grad.double(), z.grad, atol=gtol, rtol=gtol)


def test_fused_pass_equals_the_torch_pass_and_keeps_a_tiny_tail_accurate():
    case = make_case(T, WIDTH, K, temperature=1.3, seed=3)
    z = case.logits.clone()
    z[:4, :] -= 40.0  # four rows whose support holds all but ~1e-14 of the mass (the tail is summed, not 1 - S)
    support = torch.cat([case.topk.token_ids[:, None], case.topk.topk_ids], 1)
    z[torch.arange(4)[:, None], support[:4]] += 40.0
    fused = _support_pass_fused(z, support, group=None, temperature=1.3, need_probs=True, need_entropy=True)
    ref = _support_pass(z, support, group=None, temperature=1.3, chunk_size=None, need_probs=True, need_entropy=True)
    for a, b in zip(fused, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    pi = torch.softmax(z.double() / 1.3, -1)
    outside = pi.scatter(1, support, 0.0)
    assert float(outside[:4].sum(-1).max()) < 1e-10
    torch.testing.assert_close(fused[3].double(), outside.sum(-1), rtol=1e-4, atol=0)  # relative, even at 1e-14
    torch.testing.assert_close(fused[4].double(), outside.square().sum(-1), rtol=1e-4, atol=0)


def test_fused_path_is_used_only_for_cuda_logits():
    assert not kernels.fused_available(torch.zeros(2, 3))
    if torch.cuda.is_available():
        assert kernels.fused_available(torch.zeros(2, 3, device="cuda", dtype=torch.bfloat16))
        assert not kernels.fused_available(torch.zeros(2, 3, device="cuda", dtype=torch.float64))
        assert not kernels.fused_available(torch.zeros(3, 2, device="cuda").t())


@pytest.mark.e2e
def test_gpu_benchmark_script_runs_its_checks_on_cpu(tmp_path):
    """benchmarks/gpu_vocab_parallel.py --smoke: its correctness checks and timing table on tiny CPU shapes, so
    that the GPU run is not the first run of the script. megatron's fused cross entropy runs eagerly here
    (TORCHDYNAMO_DISABLE: inductor's CPU compile of it took 10 of the test's 20 s); a GPU run compiles it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_vocab_parallel.py"), "--smoke", "--reps", "1",
                          "--warmup", "0", "--out", str(tmp_path / "b.json")], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, TRITON_INTERPRET="1", TORCHDYNAMO_DISABLE="1"))
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    result = json.loads((tmp_path / "b.json").read_text())
    assert len(result["checks"]) == 9 and all(c["ok"] for c in result["checks"])
    assert [(r["T"], r["V_local"]) for r in result["timings"]] == [(8, 1100), (16, 2100)]
    assert all(r["fused_fwd_bwd_ms"] > 0 and r["mcore_fwd_bwd_ms"] > 0 for r in result["timings"])


def test_fused_kernels_take_minus_inf_logits_as_probability_zero():
    """-inf logits (entries masked by the caller, in pi's and mu's logits alike): the kernels give what the torch
    path gives, finite, including a row whose first whole block is masked and a shard that is -inf throughout."""
    case = make_case(T, WIDTH, K, temperature=0.9, seed=5)
    masked = torch.zeros(T, WIDTH, dtype=torch.bool)
    masked[0, : kernels.BLOCK + 10] = True  # the whole first block: the running max starts at -inf
    masked[1, ::3] = True
    masked[2, WIDTH - 40 :] = True  # part of the ragged last block
    support = torch.cat([case.topk.token_ids[:, None], case.topk.topk_ids], 1)
    masked.scatter_(1, support, False)  # mu's top-K and the sampled token stay finite
    case.logits = case.logits.masked_fill(masked, float("-inf"))
    case.behavior_logits = case.behavior_logits.float().masked_fill(masked, float("-inf"))
    fused = rank_fused_stats(None, case)
    for kind in TOPK_KINDS + EXACT_KINDS:
        ref = policy_statistics(case.logits, case.exact if kind in EXACT_KINDS else case.topk, kind,
                                temperature=case.temperature)
        for name, a, b in zip(ref._fields, fused[kind], ref, strict=True):
            assert torch.isfinite(a).all(), (kind, name, a)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{kind} {name}")
    assert torch.isfinite(fused["grad"]).all()
    # a row that is -inf on this whole shard (another rank holds its finite entries): m = -inf and sums 0, not NaN
    z = torch.full((2, WIDTH), float("-inf"))
    sums = kernels.row_partial_sums(z, torch.zeros(2, 1, dtype=torch.long), 1.0)
    assert sums[:, 0].isneginf().all() and (sums[:, 1:] == 0).all()
    exact = kernels.exact_partial_sums(z, z, 1.0)
    assert exact[:, [0, 2]].isneginf().all() and (exact[:, [1, 3, 4, 5, 6, 7, 8, 9]] == 0).all()
