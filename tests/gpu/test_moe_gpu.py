"""The trainer's MoE settings on CUDA (skipped without it; each case also skipped without the package it needs):
routed-expert replay under full recompute, the allgather dispatcher, DeepEP's flex dispatcher and Transformer
Engine's grouped GEMM, each against the plain path on one GPU (the CPU tests check the multi-rank layouts).

    pytest -q tests/gpu/test_moe_gpu.py     # on a GPU machine with megatron-core installed
"""

import importlib.util
import os

import pytest
import torch

from tests.helpers import TRAIN_MOE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                              reason="needs Transformer Engine")
needs_deep_ep = pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="needs DeepEP (deep_ep)")
# GPU kernels add in their own order, and the MoE combine's scatter-add with atomics in a nondeterministic one: fp32
# sums of this size differ by ~1e-6 relative between two runs of the same step; 1e-4 bounds that with room
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29556")
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    return dist.group.WORLD


def _same_step(a, b) -> None:
    (loss, norm, grads, *_), (loss_b, norm_b, grads_b, *_) = a, b
    assert loss_b == pytest.approx(loss, rel=RTOL) and norm_b == pytest.approx(norm, rel=RTOL)
    for k in grads:
        torch.testing.assert_close(grads_b[k], grads[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")


def test_r3_with_full_recompute_on_cuda(world):
    """The recomputed forward of the backward pass routes by the replayed choices (bitwise) and the step equals the
    step without recompute."""
    from tests.train.test_r3_recompute import _routing, rank_r3_step

    plain = rank_r3_step(world, TRAIN_MOE, {}, "none")
    full = rank_r3_step(world, TRAIN_MOE, {}, "full")
    _routing(*plain[3:5], "none")
    _routing(*full[3:5], "full")
    assert not plain[5] and not full[5]
    _same_step(plain, full)


def test_allgather_dispatcher_on_cuda(world):
    from tests.train.test_r3_recompute import rank_r3_step

    _same_step(rank_r3_step(world, TRAIN_MOE, {}, "none"),
               rank_r3_step(world, {**TRAIN_MOE, "moe_token_dispatcher_type": "allgather"}, {}, "none"))


@needs_deep_ep
def test_flex_dispatcher_with_deepep_on_cuda(world):
    from tests.train.test_r3_recompute import rank_r3_step

    _same_step(rank_r3_step(world, TRAIN_MOE, {}, "none"),
               rank_r3_step(world, {**TRAIN_MOE, "moe_token_dispatcher_type": "flex", "moe_enable_deepep": True}, {},
                            "none"))


@needs_te
def test_grouped_gemm_on_cuda(world):
    """Transformer Engine's grouped GEMM: the same step as one GEMM per expert, and the checkpoint mapping reads its
    weights (an HF state loaded into it exports back unchanged)."""
    from megatron_pdm.models import (
        ModelConfig,
        ParallelConfig,
        build_model,
        canonical_hf_state,
        hf_state_from_model,
        initialize_parallel,
        load_hf_into_model,
    )
    from tests.helpers import hf_model
    from tests.train.test_r3_recompute import rank_r3_step

    _same_step(rank_r3_step(world, TRAIN_MOE, {}, "none"),
               rank_r3_step(world, {**TRAIN_MOE, "moe_grouped_gemm": True}, {}, "none"))
    cfg = ModelConfig(**TRAIN_MOE, moe_grouped_gemm=True)
    state = canonical_hf_state(hf_model(cfg, seed=3).state_dict())
    with initialize_parallel(ParallelConfig()) as ctx:
        model = build_model(cfg, ctx)
        assert any(n.endswith("mlp.experts.linear_fc1.weight0") for n, _ in model.named_parameters())
        load_hf_into_model(model, state, cfg, ctx)
        back = hf_state_from_model(model, cfg, ctx)
    for k, v in state.items():
        torch.testing.assert_close(back[k].float().cpu(), v.float(), rtol=0, atol=0, msg=k)
