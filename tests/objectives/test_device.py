"""Device mistakes and host syncs, caught without a GPU.

The math runs under torch's FakeTensorMode on tensors of a non-CPU device: shapes, dtypes and devices propagate
but no value exists, so a tensor made on the CPU next to the inputs raises a device-mismatch error, and a read of a
value on the host (`.item()`, `bool(tensor)`, `nonzero`, boolean-mask indexing) raises a data-dependent error. The
device is "meta" on a CPU-only torch: fake "cuda" tensors can be created there, but indexing them raises "PyTorch is
not linked with support for cuda devices" (no CUDA device guard); with a GPU, "cuda" itself is checked too. Then
the host syncs of one micro-batch are counted on real CPU tensors.
"""

import collections
import contextlib

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from megatron_pdm.objectives import Metrics, ObjectiveConfig, loss_normalizer, policy_loss
from megatron_pdm.objectives.metrics import collective_device
from megatron_pdm.vocab_parallel import (
    EXACT_KINDS,
    KINDS,
    BehaviorLogits,
    BehaviorTopK,
    entropy,
    kernels,
    policy_statistics,
    token_logprobs,
)
from tests.reference import make_case

DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])
T, V, K = 24, 64, 5
AGGREGATIONS = ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
CONFIGS = [
    ObjectiveConfig(),  # PDM, top-K KL
    ObjectiveConfig(mask="dppo", divergence="binary_kl", loss="ppo"),
    ObjectiveConfig(mask="pdm", divergence="topk_tv", tail="uniform"),
    ObjectiveConfig(mask="ppo", loss="ppo"),
    ObjectiveConfig(mask="pdm", divergence="kl", correction="tis"),
    ObjectiveConfig(mask="none", correction="icepop"),
]


def _inputs(device, dtype=torch.bfloat16):
    """Logits [T, V] and the rest of a micro-batch, all made on `device` (inside the fake mode: no values)."""
    z = torch.randn(T, V, device=device, dtype=dtype)
    ids = torch.randint(0, V, (T,), device=device)
    topk = BehaviorTopK(ids, torch.randn(T, device=device), torch.randint(0, V, (T, K), device=device),
                        torch.randn(T, K, device=device))
    return dict(logits=z, topk=topk, exact=BehaviorLogits(ids, torch.randn(T, V, device=device, dtype=dtype)),
                advantages=torch.randn(T, device=device), loss_mask=torch.ones(T, device=device),
                sequence_ids=torch.arange(T, device=device) // 5, old_logprobs=torch.randn(T, device=device))


@contextlib.contextmanager
def _torch_path():
    """The fused kernels off: on a real GPU the torch path is then the one under test."""
    original = kernels.fused_available
    kernels.fused_available = lambda logits: False
    try:
        yield
    finally:
        kernels.fused_available = original


@contextlib.contextmanager
def _fused_path_with_shape_only_kernels():
    """The fused path's glue (core.py around the Triton kernels) with the kernels replaced by stand-ins that return
    outputs of the right shape on the logits' device."""
    names = ("fused_available", "row_partial_sums", "exact_partial_sums", "tv_sums", "logprob_grad")
    originals = {name: getattr(kernels, name) for name in names}
    kernels.fused_available = lambda logits: logits.dtype in kernels.DTYPES
    kernels.row_partial_sums = lambda z, sup, temperature: torch.rand(z.shape[0], 5, device=z.device)
    kernels.exact_partial_sums = lambda z, b, temperature: torch.rand(z.shape[0], 10, device=z.device)
    kernels.tv_sums = lambda z, b, lse, temperature: torch.rand(z.shape[0], 4, device=z.device)
    kernels.logprob_grad = lambda z, tok, lse, g, temperature: torch.empty_like(z)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(kernels, name, fn)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["torch", "fused"])
def test_the_math_makes_every_tensor_on_the_inputs_device_and_reads_no_value(device, path):
    """Before: FakeTensorDeviceMismatchError (`Metrics` bucketized with CPU bin edges, the seq_* aggregations
    index_add_-ed device ids into CPU zeros, `entropy` made its id tensor on the CPU) and
    DataDependentOutputException (`BehaviorTopK.validate`, the NaN checks of policy_statistics and policy_loss)."""
    with FakeTensorMode(), (_torch_path() if path == "torch" else _fused_path_with_shape_only_kernels()):
        x = _inputs(device)
        dev = x["logits"].device
        assert entropy(x["logits"]).device == dev
        assert token_logprobs(x["logits"], x["topk"].token_ids).device == dev
        for kind in KINDS:
            beh = x["exact"] if kind in EXACT_KINDS else x["topk"]
            s = policy_statistics(x["logits"], beh, kind, tail="proportional" if kind == "topk_kl" else "aggregated")
            assert all(t.device == dev for t in s), kind
        for aggregation in AGGREGATIONS:
            normalizer = loss_normalizer(x["loss_mask"], x["sequence_ids"], aggregation)
            assert normalizer.device == dev
            for config in CONFIGS:
                config = ObjectiveConfig(**{**config.__dict__, "aggregation": aggregation})
                leaf = x["logits"].detach().clone().requires_grad_(True)
                out = policy_loss(leaf, x["exact"] if config.divergence in EXACT_KINDS else x["topk"],
                                  x["advantages"], x["loss_mask"], config, temperature=1.0, normalizer=normalizer,
                                  sequence_ids=x["sequence_ids"], old_logprobs=x["old_logprobs"])
                out.loss.backward()
                assert out.loss.device == dev and leaf.grad.device == dev
                m = out.metrics
                for table in (m.sums, m.counts, m.maxes, m.hists):
                    assert all(v.device == dev for v in table.values())


def test_the_fake_mode_catches_a_cpu_tensor_and_a_host_read():
    """The harness itself: what the test above relies on."""
    with FakeTensorMode():
        x = torch.randn(4, device="meta")
        with pytest.raises(RuntimeError, match="same device|expected to be in the same device"):
            torch.zeros(4).index_add_(0, torch.arange(4, device="meta"), x)
        with pytest.raises(RuntimeError, match="same device"):
            torch.bucketize(x, torch.ones(3))
        with pytest.raises(DataDependentOutputException):
            bool((x > 0).any())


def test_per_token_inputs_on_another_device_are_a_clear_error():
    case = make_case(6, 20, 3, seed=0)
    with FakeTensorMode():
        z = torch.randn(6, 20, device="meta")
        with pytest.raises(ValueError, match="behavior: on cpu, but the logits are on meta"):
            policy_statistics(z, case.topk, "topk_kl")
        topk = BehaviorTopK(*(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in (
            case.topk.token_ids, case.topk.token_logprobs, case.topk.topk_ids, case.topk.topk_logprobs)))
        with pytest.raises(ValueError, match="advantages: on cpu, but the logits are on meta"):
            policy_loss(z, topk, torch.ones(6), torch.ones(6, device="meta"), ObjectiveConfig(),
                        temperature=1.0, normalizer=1.0)
        with pytest.raises(ValueError, match="topk_ids: on cpu, but token_ids on meta"):
            BehaviorTopK(topk.token_ids, topk.token_logprobs, case.topk.topk_ids, topk.topk_logprobs).check_shapes(20)
    assert case.topk.to("cpu").token_ids is case.topk.token_ids


def test_collectives_run_on_the_inputs_device(monkeypatch):
    """loss_normalizer and Metrics.reduce all-reduce on the device of their inputs (a group of two, faked)."""
    seen = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: seen.append(t.device))
    group = object()
    with FakeTensorMode(), _torch_path():
        x = _inputs("meta")
        n = loss_normalizer(x["loss_mask"], x["sequence_ids"], "seq_mean_token_mean", group=group)
        out = policy_loss(x["logits"], x["topk"], x["advantages"], x["loss_mask"], ObjectiveConfig(),
                          temperature=1.0, normalizer=n)
        assert seen == [n.device]
        # reduce: three all-reduces on the metrics' device, then the one copy to the host, whose values the fake
        # mode does not have
        with pytest.raises(DataDependentOutputException):
            out.metrics.reduce(group)
        assert [d.type for d in seen] == ["meta"] * 4


def test_collective_device_for_an_nccl_group(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend, want in (("nccl", "cuda:3"), ("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu")):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert collective_device(object(), "cpu") == torch.device(want), backend
    assert collective_device(None, "cpu") == torch.device("cpu")
    assert collective_device(object(), "meta") == torch.device("meta")


# ---------------------------------------------------------------------------------------------- host syncs


@contextlib.contextmanager
def count_host_syncs():
    """Counts the calls that read a tensor's values on the host: .item(), .tolist(), .cpu(), .numpy(), bool(),
    int(), float(), index(), nonzero and boolean-mask indexing (each a device synchronisation on a GPU)."""
    counts = collections.Counter()
    patched = []

    def wrap(owner, name):
        original = getattr(owner, name)

        def counting(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        setattr(owner, name, counting)
        patched.append((owner, name, original))

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        wrap(torch.Tensor, name)
    wrap(torch, "nonzero")
    getitem = torch.Tensor.__getitem__

    def counting_getitem(self, idx):
        items = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
            counts["bool_mask_index"] += 1
        return getitem(self, idx)

    torch.Tensor.__getitem__ = counting_getitem
    patched.append((torch.Tensor, "__getitem__", getitem))
    try:
        yield counts
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_a_micro_batch_reads_nothing_back_to_the_host(aggregation):
    """policy_loss forward + backward and loss_normalizer: 0 host syncs (before: 11 per micro-batch, 12 with
    seq_mean_token_mean: 9 bool() of validation and NaN checks, a boolean-mask index and a nonzero in Metrics and
    the backward, an int() of the largest sequence id). Metrics.reduce, once per step: one copy to the host (before:
    36 reads, one float() per metric)."""
    case = make_case(T, V, K, seed=0)
    A = torch.randn(T, generator=torch.Generator().manual_seed(1))
    seq, mask = torch.arange(T) // 5, torch.ones(T)
    metrics = Metrics()
    for config in CONFIGS:
        config = ObjectiveConfig(**{**config.__dict__, "aggregation": aggregation})
        z = case.logits.clone().requires_grad_(True)
        beh = case.exact if config.divergence in EXACT_KINDS else case.topk
        with count_host_syncs() as counts:
            n = loss_normalizer(mask, seq, aggregation)
            out = policy_loss(z, beh, A, mask, config, temperature=1.0, normalizer=n, sequence_ids=seq,
                              old_logprobs=case.topk.token_logprobs)
            out.loss.backward()
            metrics.merge(out.metrics)
        assert sum(counts.values()) == 0, (config, dict(counts))
    with count_host_syncs() as counts:
        metrics.reduce()
    assert counts["cpu"] == 1 and counts["item"] == counts["nonzero"] == counts["bool_mask_index"] == 0
