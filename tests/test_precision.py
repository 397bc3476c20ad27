"""Precision settings: config errors, block-FP8 quantization error bounds, the FP8-emulating rollout engine, and
fp16 training that skips an overflowing update and goes on."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pdm.precision import (
    INITIAL_LOSS_SCALE,
    PrecisionConfig,
    fp8_block_dequantize,
    fp8_block_quantize,
    megatron_model_settings,
    megatron_optimizer_settings,
    rollout_engine_dtype,
)

ROOT = Path(__file__).resolve().parents[1]
E4M3_MAX = 448.0


def test_invalid_combinations_are_errors():
    with pytest.raises(ValueError, match="precision.loss_scale: 'none' with precision.train fp16"):
        PrecisionConfig(train="fp16", loss_scale="none")
    with pytest.raises(ValueError, match="precision.train: 'int8' is not one of"):
        PrecisionConfig(train="int8")
    with pytest.raises(ValueError, match="precision.loss_scale: -1"):
        PrecisionConfig(loss_scale=-1)
    with pytest.raises(ValueError, match="precision.train: 'fp8' needs CUDA and Transformer Engine"):
        PrecisionConfig(train="fp8").check_hardware(cuda=False, transformer_engine=False)
    PrecisionConfig(train="fp8").check_hardware(cuda=True, transformer_engine=True)
    assert rollout_engine_dtype("fp8") == ("bfloat16", "fp8") and rollout_engine_dtype("fp16") == ("float16", None)


@pytest.mark.parametrize("train, dtype, bf16, fp16", [
    ("fp32", torch.float32, False, False),
    ("bf16", torch.bfloat16, True, False),
    ("fp16", torch.float16, False, True),
    ("fp8", torch.bfloat16, True, False),  # bf16 weights; Transformer Engine casts to e4m3 inside its GEMMs
])
def test_megatron_settings_of_each_training_precision(train, dtype, bf16, fp16):
    prec = PrecisionConfig(train=train, fp8_recipe="blockwise")
    fp8 = {"fp8": "e4m3", "fp8_recipe": "blockwise"} if train == "fp8" else {}
    assert megatron_model_settings(prec) == {"params_dtype": dtype, "bf16": bf16, "fp16": fp16, **fp8}
    # dynamic loss scaling (the default) and no scaling are both megatron's loss_scale None; fp16 then scales
    # dynamically from 2**16, fp32 / bf16 / fp8 do not scale
    assert megatron_optimizer_settings(prec) == {"params_dtype": dtype, "bf16": bf16, "fp16": fp16,
                                                 "loss_scale": None, "initial_loss_scale": 2.0**16}
    assert INITIAL_LOSS_SCALE == 2.0**16


def test_megatron_optimizer_settings_fixed_and_no_loss_scale():
    fixed = megatron_optimizer_settings(PrecisionConfig(train="fp16", loss_scale=1024))
    assert fixed["loss_scale"] == 1024.0 and isinstance(fixed["loss_scale"], float) and fixed["fp16"]
    assert megatron_optimizer_settings(PrecisionConfig(train="bf16", loss_scale="none"))["loss_scale"] is None


@pytest.mark.parametrize("train", ["fp32", "bf16", "fp16", "fp8"])
def test_megatron_settings_build_megatron_configs(train):
    """megatron-core takes the settings as they are: the model's TransformerConfig (through models.gpt, which also sets
    pipeline_dtype to params_dtype) and the OptimizerConfig carry each one."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_pdm.models import ModelConfig, ParallelConfig
    from megatron_pdm.models.gpt import transformer_config

    prec = PrecisionConfig(train=train, loss_scale=512.0 if train == "fp16" else "dynamic")
    model = megatron_model_settings(prec)
    tconfig = transformer_config(ModelConfig(), ParallelConfig(), **model)
    for key, value in model.items():
        assert getattr(tconfig, key) == value, key
    assert tconfig.pipeline_dtype == model["params_dtype"]
    assert (tconfig.fp8 is None) == (train != "fp8")
    opt = megatron_optimizer_settings(prec)
    oconfig = OptimizerConfig(optimizer="adam", lr=1e-3, **opt)
    for key, value in opt.items():
        assert getattr(oconfig, key) == value, key


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), m=st.integers(1, 300), log_scale=st.floats(-12, 6), seed=st.integers(0, 2**31))
def test_fp8_block_quantization_error_bound(n, m, log_scale, seed):
    """Each element is within half an e4m3 step of its block-scaled value: |w - dq(q(w))| <= 2^-4 |w| (3 mantissa
    bits) or, below e4m3's normal range, 2^-10 x the block scale (the subnormal step 2^-9, halved)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, m, generator=g, dtype=torch.float64) * 2.0**log_scale
    w[torch.rand(n, m, generator=g) < 0.05] = 0.0
    q, scales = fp8_block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scales.shape == (-(-n // 128), -(-m // 128))
    back = fp8_block_dequantize(q, scales, torch.float64)
    s = scales.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :m]
    err = (w - back).abs()
    assert torch.all(err <= torch.maximum(w.abs() * 2.0**-4, s * 2.0**-10) * (1 + 1e-6))
    # the block's largest magnitude maps to e4m3's largest finite value, exactly
    blocks = torch.nn.functional.pad(w.abs(), (0, -m % 128, 0, -n % 128)).reshape(
        scales.shape[0], 128, scales.shape[1], 128).amax(dim=(1, 3))
    assert torch.allclose(torch.where(blocks > 0, blocks / scales.double(), torch.full_like(blocks, E4M3_MAX)),
                          torch.full_like(blocks, E4M3_MAX))


def test_fp8_quantization_batches_over_experts():
    w = torch.randn(3, 130, 70)
    q, s = fp8_block_quantize(w)
    assert s.shape == (3, 2, 1)
    for e in range(3):
        qe, se = fp8_block_quantize(w[e])
        assert torch.equal(q[e].float(), qe.float()) and torch.equal(s[e], se)


@pytest.mark.parametrize("shape", [(300, 200), (2, 260, 130), (1000, 700), (129, 1), (0, 5)])
def test_fp8_quantization_in_row_chunks_gives_the_bits_of_one_pass(shape):
    """fp8_block_quantize works over row blocks of about chunk_bytes (bounded temporaries for a whole weight):
    blocks are independent, so q and the scales are bit for bit those of quantizing the tensor in one pass."""
    from megatron_pdm.precision import _fp8_quantize_rows

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * 5
    for x in (w, w.to(torch.bfloat16)):
        q, s = fp8_block_quantize(x, chunk_bytes=4 * 128 * 130)  # one or two 128-row blocks a step
        q1, s1 = _fp8_quantize_rows(x, 128)
        assert torch.equal(q.view(torch.uint8), q1.contiguous().view(torch.uint8)) and torch.equal(s, s1)


def test_fp8_rollout_engine_holds_quantized_weights():
    """The engine's linear weights are exactly the block-FP8 round trip; embeddings, output layer and norms are
    the bf16 copies; the engine's log-probs differ from bf16 serving (a real mismatch, not zero)."""
    from megatron_pdm.models import canonical_hf_state
    from megatron_pdm.rollout import EmbeddedEngine, SamplingParams
    from tests.helpers import DENSE, hf_model

    state = canonical_hf_state(hf_model(DENSE, seed=5).state_dict())
    fp8, bf16 = EmbeddedEngine(DENSE, dtype="bfloat16", quantization="fp8"), EmbeddedEngine(DENSE, dtype="bfloat16")
    fp8.update_weights(state, version=0)
    bf16.update_weights(state, version=0)
    own = fp8.model.state_dict()
    w = state["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(own["model.layers.0.mlp.down_proj.weight"],
                       fp8_block_dequantize(*fp8_block_quantize(w), torch.bfloat16))
    assert torch.equal(own["model.embed_tokens.weight"], state["model.embed_tokens.weight"].bfloat16())
    assert torch.equal(own["model.layers.0.input_layernorm.weight"],
                       state["model.layers.0.input_layernorm.weight"].bfloat16())
    params = SamplingParams(max_new_tokens=4, n=4, top_k_logprobs=5, seed=1)
    a = fp8.generate([[1, 2, 3]] * 4, params)
    b = bf16.generate([[1, 2, 3]] * 4, params)
    assert any(not torch.equal(x.token_logprobs, y.token_logprobs) for x, y in zip(a, b, strict=True))
    with pytest.raises(ValueError, match="engine quantization: 'int4'"):
        EmbeddedEngine(DENSE, quantization="int4")


def _bad_update_then_recover(group, cfg, run_dir, bad):
    """One update whose loss is scaled by `bad` on the last rank (1 elsewhere), then a good one."""
    from types import SimpleNamespace

    from megatron_pdm.models import output_weight
    from megatron_pdm.objectives import Metrics
    from megatron_pdm.train.trainer import Trainer
    from megatron_pdm.vocab_parallel import fused_output_loss

    trainer = Trainer(cfg, Path(run_dir))
    ids = torch.randint(0, cfg.model.vocab_size, (4, 8), generator=torch.Generator().manual_seed(0))
    mb = SimpleNamespace(input_ids=ids)

    def loss_fn(scale):  # mean -log pi of the inputs, through the fused output layer (from the hidden states)
        def fn(mb, hidden):
            return fused_output_loss(hidden.flatten(0, 1), output_weight(trainer.chunks[-1]),
                                     lambda rows, s, _: (-s.logprobs.sum() / ids.numel() * scale, None),
                                     token_ids=mb.input_ids.flatten()).loss, Metrics()
        return fn

    before = [p.detach().float().clone() for p in trainer.chunks[0].parameters()]
    scale0 = float(trainer.learner.optimizer.get_loss_scale())
    last = dist.get_rank() == dist.get_world_size() - 1
    trainer.learner.update([mb], loss_fn(bad if last else 1.0))  # gradients overflow or are nan: skipped
    after_overflow = [p.detach().float().clone() for p in trainer.chunks[0].parameters()]
    skipped = trainer.learner.updates_skipped
    trainer.learner.update([mb], loss_fn(1.0))
    after = [p.detach().float().clone() for p in trainer.chunks[0].parameters()]
    out = {
        "dtype": str(next(trainer.chunks[0].parameters()).dtype), "scale0": scale0, "skipped": skipped,
        "skipped_after": trainer.learner.updates_skipped,
        "unchanged_on_overflow": all(torch.equal(a, b) for a, b in zip(before, after_overflow, strict=True)),
        "changed_after": any(not torch.equal(a, b) for a, b in zip(after_overflow, after, strict=True)),
        "finite": all(torch.isfinite(p).all() for p in after),
    }
    trainer.parallel.close()
    return out


@pytest.mark.parametrize("train,bad,world", [("fp16", 1e30, 1), ("fp32", float("nan"), 2), ("bf16", float("inf"), 1)],
                         ids=["fp16-overflow", "fp32-nan-on-one-dp-rank", "bf16-inf"])
def test_training_skips_an_overflowing_or_nan_update_and_recovers(dist_pools, tmp_path, train, bad, world):
    """fp16: the grad scaler skips the overflowing update and backs off. fp32 and bf16 have no grad scaler, and
    megatron's optimizer would apply a nan gradient (the regression: nan in every weight, then in the engines):
    the update is skipped on every rank, also where only one DP rank's gradients were nan before the reduction."""
    from megatron_pdm.train.config import load_config

    cfg = load_config(ROOT / "examples" / "tiny_cpu.yaml", [f"precision.train={train}", "parallel.tensor=1",
                                                            "train.warm_start_steps=0"])
    outs = dist_pools(world).run(_bad_update_then_recover, shared=(cfg, str(tmp_path), bad))
    dtype = {"fp16": "torch.float16", "fp32": "torch.float32", "bf16": "torch.bfloat16"}[train]
    for out in outs:
        assert out["dtype"] == dtype and (train != "fp16" or out["scale0"] == 2.0**16)
        assert out["skipped"] == 1 and out["unchanged_on_overflow"]
        assert out["skipped_after"] == 1 and out["changed_after"] and out["finite"]
