"""`policy_loss` on CUDA against the float64 CPU references (skipped without CUDA; the comparison itself also runs
on a CPU, in float32, so that it is checked everywhere).

    pytest -q -s tests/gpu/test_policy_loss_gpu.py     # writes policy_loss_gpu.json under $MEGATRON_PDM_GPU_OUT

For seeded random logits (bf16 or fp32, as the model emits them) and a top-K behavior, the device's loss, logits
gradient, log pi(k), D and Ddot are compared with (a) `policy_loss` in float64 on the CPU (same code, exact inputs:
every bf16 / fp32 value is a float64) and (b) the independent full-vocabulary float64 reference of
tests/helpers.py (`ref_loss`). A mask decision may flip where a token sits on a threshold within float32
rounding; those rows (at most 1 in 1000, counted and reported) are left out of the row-wise comparisons.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from megatron_pdm.objectives import ObjectiveConfig, loss_normalizer, policy_loss
from megatron_pdm.vocab_parallel import BehaviorTopK
from tests.helpers import CONFIGS, ref_loss
from tests.reference import make_case

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# |error| bounds relative to the largest reference magnitude: fp32 math on exact inputs (sums over up to 152K
# entries; measured on a CPU: 6e-6 at most), except the gradient with respect to bf16 logits, which is itself
# rounded to bf16 (8 significant bits; measured: 3e-3)
REL_TOL = {torch.float32: {"grad": 5e-5, "other": 5e-5}, torch.bfloat16: {"grad": 8e-3, "other": 5e-5}}


def _inputs(T, V, K, dtype, seed):
    case = make_case(T, V, K, dtype=dtype, noise=1.0, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    A = torch.randn(T, generator=g).double()  # float32 values, as the trainer's advantages
    loss_mask = (torch.rand(T, generator=g) > 0.1).double()
    seq_ids = torch.arange(T) // 16
    # pi_ref for the KL penalty: the logits moved by noise, in the logits' dtype (as the reference emits them);
    # log pi_ref(k) for the estimators, the logits for the exact KL
    ref_z = (case.logits.double() + torch.randn(case.logits.shape, generator=g).double()).to(dtype).double()
    ref_lp = torch.log_softmax(ref_z, -1).gather(1, case.topk.token_ids[:, None]).squeeze(-1)
    return case, A, loss_mask, seq_ids, (ref_lp, ref_z)


def _run(z, behavior, A, loss_mask, seq_ids, config, device, dtype, ref):
    """policy_loss on `device` with logits of `dtype`; returns (loss, grad, keep, stats) as float64 on the CPU."""
    z = z.to(device=device, dtype=dtype).detach().requires_grad_(True)
    to = lambda t: t.to(device)  # noqa: E731
    behavior = BehaviorTopK(*(to(t) for t in (behavior.token_ids, behavior.token_logprobs, behavior.topk_ids,
                                              behavior.topk_logprobs)))
    adv = A.to(device, torch.float64 if dtype == torch.float64 else torch.float32)
    normalizer = loss_normalizer(to(loss_mask), to(seq_ids), config.aggregation)
    out = policy_loss(z, behavior, adv, to(loss_mask), config, temperature=1.0, normalizer=normalizer,
                      sequence_ids=to(seq_ids), ref_logprobs=to(ref[0]) if config.kl_coef else None,
                      ref_logits=ref[1].to(device, dtype) if config.kl_type == "exact" else None)
    out.loss.backward()
    cpu = lambda t: t.detach().double().cpu()  # noqa: E731
    stats = {name: cpu(getattr(out.stats, name)) for name in ("logprobs", "divergence", "predicted_change")}
    return cpu(out.loss), cpu(z.grad), out.mask.keep.cpu(), stats


def compare_policy_loss(device, dtype, config: ObjectiveConfig, *, T=256, V=16384, K=20, seed=0) -> dict:
    """Asserts the device's policy_loss equals the float64 references; returns the errors (relative to the largest
    reference magnitude) and the number of mask flips."""
    case, A, loss_mask, seq_ids, refs = _inputs(T, V, K, dtype, seed)
    loss, grad, keep, stats = _run(case.logits, case.topk, A, loss_mask, seq_ids, config, device, dtype, refs)
    loss64, grad64, keep64, stats64 = _run(case.logits, case.topk, A, loss_mask, seq_ids, config, "cpu",
                                           torch.float64, refs)
    normalizer = float(loss_normalizer(loss_mask, seq_ids, config.aggregation))
    ref, ref_grad = ref_loss(case, A, loss_mask, seq_ids, config, normalizer, *refs)
    torch.testing.assert_close(loss64, ref, atol=1e-10, rtol=1e-8)  # the two float64 references agree
    torch.testing.assert_close(grad64, ref_grad, atol=1e-10, rtol=1e-8)
    flips = int((keep != keep64).sum())
    assert flips <= T // 1000, f"{flips} mask decisions differ from float64 (of {T} tokens)"
    same = keep == keep64
    tol = REL_TOL[dtype]

    def rel_err(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))

    out = {"tokens": T, "vocab": V, "mask_flips": flips, "masked_frac": float((~keep64).double().mean())}
    for name in stats:
        out[f"{name}_rel_err"] = rel_err(stats[name][same], stats64[name][same])
    out["grad_rel_err"] = rel_err(grad[same], ref_grad[same])
    if flips == 0:
        out["loss_rel_err"] = rel_err(loss, ref)
    for name, err in out.items():
        if name.endswith("_rel_err"):
            bound = tol["grad"] if name == "grad_rel_err" else tol["other"]
            assert err <= bound, f"{name}: {err:.3e} > {bound:.0e} ({dtype}, {config})"
    return out


@pytest.fixture(scope="module")
def results():
    """Numbers of every case, written to $MEGATRON_PDM_GPU_OUT/policy_loss_gpu.json after the module."""
    numbers = {}
    yield numbers
    out = os.environ.get("MEGATRON_PDM_GPU_OUT")
    if out and numbers:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "policy_loss_gpu.json").write_text(json.dumps(numbers, indent=2) + "\n")


def _name(config):
    return (f"{config.mask}-{config.divergence}-{config.loss}-{config.aggregation}"
            + (f"-kl_{config.kl_type}" if config.kl_coef else "") + ("-entropy" if config.entropy_coef else ""))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("config", CONFIGS, ids=_name)
def test_policy_loss_cuda_matches_float64(results, config, dtype):
    numbers = compare_policy_loss(torch.device("cuda"), dtype, config)
    results[f"{_name(config)}/{str(dtype).removeprefix('torch.')}"] = numbers
    print(_name(config), dtype, numbers)


@needs_cuda
def test_policy_loss_cuda_at_qwen3_vocabulary(results):
    """Qwen3's 151,936-row vocabulary: the chunked paths over a realistic shard width."""
    numbers = compare_policy_loss(torch.device("cuda"), torch.bfloat16, ObjectiveConfig(), T=64, V=151936)
    results["qwen3-vocab/bfloat16"] = numbers
    print(numbers)


@pytest.mark.parametrize("config", CONFIGS, ids=_name)
def test_the_comparison_runs_on_a_cpu(config):
    numbers = compare_policy_loss(torch.device("cpu"), torch.float32, config, T=64, V=300, K=8)
    assert numbers["mask_flips"] == 0 and numbers["grad_rel_err"] < 1e-5


# the fused output layer against the unfused path on one device: the same bf16 / fp32 GEMM for the logits and the
# logits' gradient in their dtype, but the chunks' GEMMs take other shapes and the weight gradient sums chunk
# partials rounded to bf16 (unfused: one bf16 GEMM), so bf16 differs by its rounding
FUSED_REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
FUSED_CONFIGS = [ObjectiveConfig(), ObjectiveConfig(entropy_coef=0.01),
                 ObjectiveConfig(kl_coef=0.1, kl_type="exact", entropy_coef=0.01)]


def compare_fused(device, dtype, config: ObjectiveConfig, *, T=512, V=32768, H=256, K=20, seed=0) -> dict:
    """`policy_loss_from_hidden` (chunks of 100 rows) against `policy_loss` on hidden @ W^T, both on `device` with
    hidden states and weight of `dtype`: loss, both gradients, log pi(k), D, Ddot, relative to the largest unfused
    magnitude. Asserts them within FUSED_REL_TOL and returns them."""
    from megatron_pdm.objectives import policy_loss_from_hidden

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (2.0 / H**0.5)
    case = make_case(T, V, K, dtype=torch.float32, noise=1.0, seed=seed, logits=hidden.double() @ weight.double().t())
    ref_hidden = (hidden + 0.3 * torch.randn(T, H, generator=g)).to(device, dtype)
    ref_weight = (weight + 0.1 * torch.randn(V, H, generator=g) / H**0.5).to(device, dtype)
    exact = bool(config.kl_coef) and config.kl_type == "exact"
    A = torch.randn(T, generator=g).to(device)
    loss_mask = (torch.rand(T, generator=g) > 0.1).float().to(device)
    behavior = BehaviorTopK(*(t.to(device) for t in (case.topk.token_ids, case.topk.token_logprobs,
                                                      case.topk.topk_ids, case.topk.topk_logprobs)))
    normalizer = loss_normalizer(loss_mask, None, "token_mean")
    runs = []
    for fused in (False, True):
        x = hidden.to(device, dtype).requires_grad_(True)
        w = weight.to(device, dtype).requires_grad_(True)
        kw = dict(temperature=1.0, normalizer=normalizer)
        if fused:
            out = policy_loss_from_hidden(x, w, behavior, A, loss_mask, config, chunk_rows=100, **kw,
                                          ref_hidden=ref_hidden if exact else None,
                                          ref_output_weight=ref_weight if exact else None)
        else:
            out = policy_loss(x @ w.t(), behavior, A, loss_mask, config, **kw,
                              ref_logits=ref_hidden @ ref_weight.t() if exact else None)
        out.loss.backward()
        runs.append({"loss": out.loss, "grad_hidden": x.grad, "grad_weight": w.grad,
                     **{n: getattr(out.stats, n) for n in ("logprobs", "divergence", "predicted_change")}})
    numbers = {}
    for name, want in runs[0].items():
        got, want = runs[1][name].detach().double().cpu(), want.detach().double().cpu()
        numbers[f"{name}_rel_err"] = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
        assert numbers[f"{name}_rel_err"] <= FUSED_REL_TOL[dtype], (name, numbers, dtype)
    return numbers


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("config", FUSED_CONFIGS, ids=_name)
def test_fused_output_layer_cuda_matches_unfused(results, config, dtype):
    """The fused output layer on CUDA against the unfused path: the chunks' statistics and log pi(k) gradient through
    the Triton kernels (default), the entropy bonus's torch backward, the exact KL to a reference."""
    numbers = compare_fused(torch.device("cuda"), dtype, config)
    results[f"fused/{_name(config)}/{str(dtype).removeprefix('torch.')}"] = numbers
    print("fused", _name(config), dtype, numbers)


@pytest.mark.parametrize("config", FUSED_CONFIGS, ids=_name)
def test_the_fused_comparison_runs_on_a_cpu(config):
    compare_fused(torch.device("cpu"), torch.float32, config, T=64, V=512, H=32, K=8)
