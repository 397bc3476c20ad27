"""Compat patch 11: bf16 / fp16 CPU matrix products emulated in float32 where the CPU has no native GEMM.

The decision (CPU flags, oneDNN's ISA limit, the override), the emulation's agreement with a native GEMM to the
float32 summation-order bound (bf16: native on a host with avx512_bf16) or with the float64 product rounded the same
way (fp16: native nowhere here), its gradients, that it is inert on float32 and meta tensors, the engine's weight
cache, and that the embedded engine and the trainer's forward / backward run their products through it."""

import collections
import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_pdm.compat import cpu as compat
from megatron_pdm.compat import lowp_gemm_emulated, lowp_gemm_scope
from megatron_pdm.compat.cpu import LOWP_GEMM_ENV, cpu_flags, lowp_gemm_native

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the emulation applies only without CUDA")

BF16, FP16 = torch.bfloat16, torch.float16
AVX2_HOST = "processor\t: 0\nmodel name\t: AMD EPYC 7B12\nflags\t\t: fpu sse4_1 avx avx2 fma\n"
ZEN5_HOST = "processor\t: 0\nflags\t\t: avx2 avx512f avx512bw avx512_bf16 avx512_vnni\nprocessor\t: 1\nflags\t: x\n"
SPR_HOST = "flags\t\t: avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile\n"


def test_cpu_flags_are_the_first_processors():
    assert cpu_flags(ZEN5_HOST) == {"avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
    assert cpu_flags("") == frozenset() and cpu_flags("Features\t: fp asimd bf16\n") == frozenset()  # not x86


@pytest.mark.parametrize("dtype, flags, isa, native", [
    (BF16, {"avx2"}, None, False),                          # an AVX2-only host
    (BF16, {"avx512_bf16"}, None, True),
    (BF16, {"amx_bf16"}, None, True),
    (BF16, {"avx512_bf16"}, "AVX2", False),                 # what the AVX2 simulation sets
    (BF16, {"avx512_bf16"}, "AVX512_CORE_VNNI", False),
    (BF16, {"avx512_bf16"}, "AVX512_CORE_BF16", True),
    (BF16, {"avx512_bf16"}, "avx512_core_amx", True),       # read in upper case
    (BF16, {"avx512_bf16"}, "AVX2_VNNI_2", False),          # the order is partial: not above AVX512_CORE_BF16
    (BF16, {"avx512_bf16"}, "DEFAULT", True),
    (FP16, {"avx512_bf16"}, None, False),                   # this project's Zen 5 host
    (FP16, {"avx512_bf16", "avx512_fp16"}, None, True),
    (FP16, {"avx512_fp16"}, "AVX512_CORE_BF16", False),
    (FP16, {"avx512_fp16"}, "AVX10_1_512", True),           # AVX512_CORE_FP16's other name
    (FP16, {"amx_fp16"}, "AVX512_CORE_AMX_FP16", True),
])
def test_native_means_the_instructions_and_onednn_allowed_to_use_them(dtype, flags, isa, native):
    assert lowp_gemm_native(dtype, frozenset(flags), isa) is native


def test_the_override_decides_and_bad_values_are_refused(monkeypatch):
    env = lambda **kw: {k: v for k, v in kw.items() if v is not None}  # noqa: E731
    assert lowp_gemm_emulated(BF16, environ=env(), cpuinfo=AVX2_HOST)
    assert not lowp_gemm_emulated(BF16, environ=env(), cpuinfo=ZEN5_HOST)
    assert lowp_gemm_emulated(FP16, environ=env(), cpuinfo=ZEN5_HOST)
    assert not lowp_gemm_emulated(FP16, environ=env(), cpuinfo=SPR_HOST)
    assert lowp_gemm_emulated(BF16, environ=env(ONEDNN_MAX_CPU_ISA="AVX2"), cpuinfo=SPR_HOST)
    assert lowp_gemm_emulated(BF16, environ=env(), cpuinfo="")  # no flags to read: emulated, exact either way
    assert not lowp_gemm_emulated(BF16, environ={LOWP_GEMM_ENV: "native"}, cpuinfo=AVX2_HOST)
    assert lowp_gemm_emulated(BF16, environ={LOWP_GEMM_ENV: "emulated"}, cpuinfo=SPR_HOST)
    assert not lowp_gemm_emulated(torch.float32, environ={LOWP_GEMM_ENV: "emulated"}, cpuinfo=AVX2_HOST)
    with pytest.raises(ValueError, match="MEGATRON_PDM_CPU_LOWP_GEMM: 'fast' is not one of auto, native, emulated"):
        lowp_gemm_emulated(BF16, environ={LOWP_GEMM_ENV: "fast"}, cpuinfo=AVX2_HOST)
    with pytest.raises(ValueError, match="ONEDNN_MAX_CPU_ISA: 'AVX3' is not a oneDNN ISA name"):
        lowp_gemm_emulated(BF16, environ={"ONEDNN_MAX_CPU_ISA": "AVX3"}, cpuinfo=AVX2_HOST)
    monkeypatch.setenv(LOWP_GEMM_ENV, "emulated")
    assert isinstance(lowp_gemm_scope(torch.float32), contextlib.nullcontext)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not lowp_gemm_emulated(BF16)  # never on a CUDA machine
    assert isinstance(lowp_gemm_scope(BF16), contextlib.nullcontext)


def test_an_engine_refuses_a_bad_override_before_any_compute(monkeypatch):
    from megatron_pdm.models import ModelConfig
    from megatron_pdm.rollout.embedded import EmbeddedEngine

    monkeypatch.setenv(LOWP_GEMM_ENV, "yes")
    with pytest.raises(ValueError, match="MEGATRON_PDM_CPU_LOWP_GEMM: 'yes'"):
        EmbeddedEngine(ModelConfig(), dtype="bfloat16")


# (name, product, input shapes, the longest sum in it or its gradients)
PRODUCTS = [
    ("mm", lambda a, b: a @ b, [(16, 64), (64, 24)], 64),
    ("matmul, broadcast", torch.matmul, [(2, 8, 64), (64, 24)], 64),
    ("bmm", torch.bmm, [(3, 8, 32), (3, 32, 16)], 32),
    ("addmm", lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0), [(24,), (16, 64), (64, 24)], 65),
    ("baddbmm, core attention's", lambda c, q, k: torch.baddbmm(c, q, k, beta=0.0, alpha=0.125),
     [(3, 8, 8), (3, 8, 32), (3, 32, 8)], 32),
    ("linear with bias", F.linear, [(2, 8, 64), (24, 64), (24,)], 64),
    ("einsum", lambda x, w: torch.einsum("bsh,nh->bsn", x, w), [(2, 8, 64), (24, 64)], 64),
    ("mv", torch.mv, [(16, 64), (64,)], 64),
]
U32 = 2.0**-24  # float32's unit roundoff


def _inputs(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def _run(product, inputs, grad):
    """(output, gradients of <output, grad> with respect to every input)."""
    xs = [x.detach().requires_grad_() for x in inputs]
    out = product(*xs)
    return out.detach(), [g.detach() for g in torch.autograd.grad(out, xs, grad)]


MANTISSA = {BF16: 7, FP16: 10}  # explicit significand bits


def _ulp(y: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of `dtype` at |y| (float64; its subnormal spacing below its normal range)."""
    _, e = torch.frexp(y.double())  # |y| = m 2^e, m in [0.5, 1)
    fi = torch.finfo(dtype)
    return torch.ldexp(torch.ones_like(e, dtype=torch.float64), e - 1 - MANTISSA[dtype]).clamp_min(
        fi.smallest_normal * fi.eps)


def _assert_within(a, b, dtype, sums, k, roundings):
    """|a - b| <= ulp(max(|a|, |b|)) + roundings x gamma_k x sums: each of a, b is within half an ulp of its own
    float32 (or float64) sum, rounded to nearest (half an ulp of the rounded value bounds it, across a binade too),
    and the two sums differ by at most `roundings` float32 summation errors of k terms, gamma_k x sum |x_i y_i|
    each (Higham, any order of summation)."""
    gamma = k * U32 / (1 - k * U32)
    a64, b64 = a.double(), b.double()
    bound = _ulp(torch.maximum(a64.abs(), b64.abs()), dtype) + roundings * gamma * sums
    assert bool(((a64 - b64).abs() <= bound).all()), float(((a64 - b64).abs() - bound).max())


def _sums(product, inputs, grad):
    """sum |x_i y_i| of every output and gradient entry: the product (and its gradients) on absolute values."""
    return _run(product, [x.double().abs() for x in inputs], grad.double().abs())


@pytest.mark.parametrize("name, product, shapes, k", PRODUCTS, ids=[p[0] for p in PRODUCTS])
def test_emulated_bf16_agrees_with_the_native_gemm_to_summation_order(monkeypatch, name, product, shapes, k):
    """Both are float32 sums of the exact bf16 products rounded once to bf16, in different orders: the bound of
    `_assert_within` with two summation errors. Needs a native bf16 GEMM (avx512_bf16 / amx_bf16: this project's
    Zen 5 host) for the other side."""
    if not lowp_gemm_native(BF16, cpu_flags(compat._host_cpuinfo()), None):
        pytest.skip("no native bf16 GEMM on this CPU to compare with")
    inputs = _inputs(shapes, BF16)
    out_shape = product(*[x.float() for x in inputs]).shape
    grad = torch.randn(out_shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(BF16)
    monkeypatch.setenv(LOWP_GEMM_ENV, "native")
    native = _run(product, inputs, grad)
    monkeypatch.setenv(LOWP_GEMM_ENV, "emulated")
    with lowp_gemm_scope(BF16):
        emulated = _run(product, inputs, grad)
    sums = _sums(product, inputs, grad)
    assert emulated[0].dtype == BF16 and all(g.dtype == BF16 for g in emulated[1])
    for e, n, s in zip([emulated[0], *emulated[1]], [native[0], *native[1]], [sums[0], *sums[1]], strict=True):
        _assert_within(e, n, BF16, s, k, roundings=2)


@pytest.mark.parametrize("name, product, shapes, k", PRODUCTS, ids=[p[0] for p in PRODUCTS])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_emulated_products_agree_with_the_rounded_float64_product(monkeypatch, name, product, shapes, k, dtype):
    """The float64 product of the same low-precision inputs rounded to the low dtype, against the emulation: one
    float32 summation error (float64's own is below it by 2^-29) plus the two roundings. fp16 has no native GEMM
    on this project's hosts: this is its check."""
    inputs = _inputs(shapes, dtype)
    out_shape = product(*[x.float() for x in inputs]).shape
    grad = torch.randn(out_shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    monkeypatch.setenv(LOWP_GEMM_ENV, "emulated")
    with lowp_gemm_scope(dtype):
        emulated = _run(product, inputs, grad)
    out64, grads64 = _run(product, [x.double() for x in inputs], grad.double())
    sums = _sums(product, inputs, grad)
    for e, r, s in zip([emulated[0], *emulated[1]], [out64, *grads64], [sums[0], *sums[1]], strict=True):
        _assert_within(e, r.to(dtype), dtype, s, k, roundings=1.001)


def test_the_emulation_is_the_float32_product_rounded_once(monkeypatch):
    a, b = _inputs([(3, 16, 64), (3, 64, 24)], BF16)
    monkeypatch.setenv(LOWP_GEMM_ENV, "emulated")
    with lowp_gemm_scope(BF16):
        mm, bmm = a[0] @ b[0], torch.bmm(a, b)
    assert torch.equal(mm, (a[0].float() @ b[0].float()).to(BF16))  # the same float32 kernel: bitwise
    assert torch.equal(bmm, torch.bmm(a.float(), b.float()).to(BF16))


def test_the_scope_is_inert_on_float32_and_meta_tensors(monkeypatch):
    a, b = _inputs([(16, 64), (64, 24)], torch.float32)
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(2))
    monkeypatch.setenv(LOWP_GEMM_ENV, "emulated")
    outside = (a @ b, F.linear(a, w), torch.bmm(a[None], b[None]))
    with lowp_gemm_scope(BF16):  # a bf16 scope that meets float32 products: the trainer's float32 loss math
        inside = (a @ b, F.linear(a, w), torch.bmm(a[None], b[None]))
        meta = torch.empty(16, 64, dtype=BF16, device="meta") @ torch.empty(64, 24, dtype=BF16, device="meta")
        mixed = torch.addmm(torch.zeros(24), a, b)  # not all bf16: torch's own product
    assert all(torch.equal(x, y) for x, y in zip(inside, outside, strict=True))
    assert meta.device.type == "meta" and meta.dtype == BF16 and meta.shape == (16, 24)
    assert torch.equal(mixed, torch.addmm(torch.zeros(24), a, b))


def test_the_weight_cache_converts_each_weight_once_and_sees_in_place_updates(monkeypatch):
    x, w0 = _inputs([(4, 64), (24, 64)], BF16)
    w = torch.nn.Parameter(w0.clone())
    monkeypatch.setenv(LOWP_GEMM_ENV, "emulated")
    with lowp_gemm_scope(BF16):
        plain = F.linear(x, w), x @ w.t(), w @ x.t()
    with torch.no_grad(), lowp_gemm_scope(BF16, cache_weights=True) as mode:
        cached = F.linear(x, w), x @ w.t(), w @ x.t()
        assert len(mode.weights) == 1  # w and its transposed view: one float32 copy
        w.mul_(2)  # an in-place update (a weight load): the copy is made again
        doubled = x @ w.t()
    assert all(torch.equal(c, p) for c, p in zip(cached, plain, strict=True))
    assert torch.equal(doubled, (x.float() @ (2 * w0).float().t()).to(BF16))


@contextlib.contextmanager
def _counting_products():
    """{(aten op, grad mode): count} of the products the emulation computes in float32."""
    seen = collections.Counter()
    original = compat._LowpGemmMode.__torch_dispatch__

    def spy(self, func, types, args=(), kwargs=None):
        if func in compat._GEMMS and compat._lowp_dtype((*args, *(kwargs or {}).values()), self.dtype):
            seen[str(func).removeprefix("aten.").removesuffix(".default")] += 1
        return original(self, func, types, args, kwargs)

    compat._LowpGemmMode.__torch_dispatch__ = spy
    try:
        yield seen
    finally:
        compat._LowpGemmMode.__torch_dispatch__ = original


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_the_embedded_engine_generates_with_emulated_products(monkeypatch, quantization):
    """bf16 rollouts, and fp8 ones (block-FP8 weights dequantized into bf16: bf16 products, no FP8 GEMM)."""
    from megatron_pdm.models import ModelConfig
    from megatron_pdm.rollout.base import SamplingParams
    from megatron_pdm.rollout.embedded import EmbeddedEngine

    torch.manual_seed(0)
    engine = EmbeddedEngine(ModelConfig(), dtype="bfloat16", quantization=quantization)
    engine.update_weights({k: v.float() for k, v in engine.model.state_dict().items()}, version=0)
    params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=5)
    monkeypatch.setenv(LOWP_GEMM_ENV, "emulated")
    with _counting_products() as seen:
        emulated = engine.generate([[1, 2, 3], [4, 5]], params)
    assert seen["mm"] > 0  # every linear layer's product, at every decode step
    # the attention's products too (review of issue 56: SDPA's fused CPU kernel passed the emulation by, native bf16)
    assert seen["bmm"] > 0  # q k^T and p v of every layer (eager attention's batched products)
    assert engine.model.config._attn_implementation != "eager"  # put back after the generation
    monkeypatch.setenv(LOWP_GEMM_ENV, "native")
    with _counting_products() as none:
        native = engine.generate([[1, 2, 3], [4, 5]], params)
    assert not none
    assert [len(s.token_logprobs) for s in emulated] == [len(s.token_logprobs) for s in native] == [3, 3]


def rank_learner_products(group):
    """The products a bf16 Learner's forward_backward emulates (one micro-batch, forward and backward), emulation
    forced (MEGATRON_PDM_CPU_LOWP_GEMM=emulated)."""
    import os

    from megatron_pdm.models import ParallelConfig, initialize_parallel
    from megatron_pdm.train.config import config_from_dict
    from megatron_pdm.train.step import Learner
    from tests.helpers import TRAIN_DENSE

    os.environ[LOWP_GEMM_ENV] = "emulated"
    try:
        cfg = config_from_dict({"model": TRAIN_DENSE, "precision": {"train": "bf16", "rollout": "bf16"},
                                "train": {"init": "random", "warm_start_steps": 0}})
        ctx = initialize_parallel(ParallelConfig(), seed=0)
        learner = Learner(cfg, torch.device("cpu"), ctx)
        ids = torch.randint(0, TRAIN_DENSE["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
        with _counting_products() as seen:
            learner.forward_backward([SimpleNamespace(input_ids=ids)],
                                     lambda mb, out: (out.float().square().mean(), None))
        ctx.close()
        return dict(seen)
    finally:
        del os.environ[LOWP_GEMM_ENV]


def test_the_learners_forward_and_backward_emulate_bf16_products(dist_pools):
    """megatron's linear layers (a custom autograd Function: forward and backward products) and its core attention
    (baddbmm, bmm) run through the emulation in the trainer's one forward / backward path."""
    from tests.helpers import TRAIN_DENSE

    seen = dist_pools(1).run(rank_learner_products)[0]
    layers = TRAIN_DENSE["num_layers"]
    # per layer: q/k/v, projection, fc1, fc2 forward (4) and their two backward products each (8); the output
    # layer's product is the fused loss's, which this loss does not call
    assert seen["mm"] >= 12 * layers and seen["baddbmm"] == layers and seen["bmm"] >= layers
