"""GPU checks (skipped without CUDA): the TE layer spec and the CUDA path of the vocab-parallel math.

    pytest -q tests/gpu        # on a GPU machine with megatron-core and Transformer Engine installed
"""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_vocab_parallel_cuda_matches_the_float64_reference():
    from megatron_pdm.vocab_parallel import policy_statistics
    from tests.reference import make_case, ref_divergence_and_change, ref_logpi

    case = make_case(512, 4096, 20, dtype=torch.bfloat16, temperature=0.9)
    z = case.logits.cuda().requires_grad_(True)
    topk = case.topk
    behavior = type(topk)(*(t.cuda() for t in (topk.token_ids, topk.token_logprobs, topk.topk_ids,
                                                topk.topk_logprobs)))
    s = policy_statistics(z, behavior, "topk_kl", temperature=0.9)
    d, dd = ref_divergence_and_change(case, "topk_kl")
    torch.testing.assert_close(s.divergence.double().cpu(), d, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(s.predicted_change.double().cpu(), dd, atol=2e-5, rtol=2e-5)
    lp = ref_logpi(case.logits, 0.9).gather(1, topk.token_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(s.logprobs.double().cpu(), lp, atol=2e-5, rtol=2e-5)
    s.logprobs.sum().backward()
    assert z.grad.shape == z.shape and torch.isfinite(z.grad).all()


def test_te_spec_model_matches_transformers():
    pytest.importorskip("transformer_engine")
    import torch.distributed as dist

    from megatron_pdm.models import (
        ModelConfig,
        ParallelConfig,
        build_model,
        canonical_hf_state,
        forward_logits,
        initialize_parallel,
        load_hf_into_model,
    )
    from megatron_pdm.models.gpt import te_available
    from tests.helpers import hf_model

    assert te_available()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29555")
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    for cfg in (ModelConfig(vocab_size=128), ModelConfig(model_type="qwen3_moe", vocab_size=128, num_experts=4)):
        hf = hf_model(cfg)
        with initialize_parallel(ParallelConfig()) as ctx:
            model = build_model(cfg, ctx).cuda().eval()
            load_hf_into_model(model, canonical_hf_state(hf.state_dict()), cfg, ctx)
            ids = torch.randint(0, cfg.vocab_size, (2, 32))
            with torch.no_grad():
                torch.testing.assert_close(forward_logits(model, ids.cuda()).float().cpu(), hf(ids).logits,
                                           atol=2e-3, rtol=2e-3)
