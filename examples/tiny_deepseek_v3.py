"""Write a tiny random DeepSeek-V3 checkpoint, block-FP8 as DeepSeek-V3 and Kimi-K2 are released, for
examples/tiny_deepseek_v3.yaml.

    python examples/tiny_deepseek_v3.py [--out runs/tiny_deepseek_v3_init]
    megatron-pdm train --config examples/tiny_deepseek_v3.yaml

The architecture of examples/presets/deepseek_v3.yaml at toy size, made by transformers' DeepseekV3ForCausalLM:
multi-latent attention with q / kv LoRA and YaRN (factor 40, beta 32 / 1, mscale_all_dim 1), one dense layer then
two MoE layers of 8 routed experts (top-4 within 2 of 4 groups, sigmoid scores, routed scale 2.5) beside one
shared expert, and an expert bias drawn N(0, 0.1^2) (the trainer must load it: routing differs without it). Its
linear weights are stored as float8_e4m3fn with 128 x 128 block scales (`weight_scale_inv`, quantization_config in
config.json), which the trainer dequantizes tensor by tensor at load. The arithmetic task's tokenizer (vocabulary
of 16 ids in 320 embedding rows) sits beside the weights. Like the release, it holds one multi-token-prediction
layer (`model.layers.3.*`), which RL does not train and the export carries unchanged.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def tiny_deepseek_v3_config():
    from megatron_pdm.models import ModelConfig

    return ModelConfig(model_type="deepseek_v3", vocab_size=320, hidden_size=64, num_layers=3, num_attention_heads=4,
                       num_query_groups=4, head_dim=16, ffn_hidden_size=128, num_experts=8, moe_ffn_hidden_size=32,
                       moe_router_topk=4, moe_first_k_dense=1, moe_shared_expert_ffn_hidden_size=32,
                       moe_router_num_groups=4, moe_router_group_topk=2, moe_routed_scaling_factor=2.5,
                       moe_aux_loss_coeff=0.0, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
                       rope_theta=10000.0, rope_scaling="yarn", rope_scaling_factor=40.0,
                       rope_original_max_position_embeddings=4096, rope_mscale=1.0, rope_mscale_all_dim=1.0,
                       max_position_embeddings=163840, mtp_num_layers=1)


def write_checkpoint(out: Path, *, seed: int = 0) -> Path:
    """The checkpoint directory `out`: weights (block-FP8), config.json and the arithmetic tokenizer."""
    import transformers

    from megatron_pdm.models import canonical_hf_state, hf_config_dict, save_hf_checkpoint
    from megatron_pdm.train.data import ARITHMETIC_TOKENIZER

    cfg = tiny_deepseek_v3_config()
    torch.manual_seed(seed)
    hf_cfg = transformers.AutoConfig.for_model(
        **{k: v for k, v in hf_config_dict(cfg).items() if k not in ("architectures", "torch_dtype")})
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    state = canonical_hf_state(model.state_dict()) | mtp_layer(cfg, g)
    return save_hf_checkpoint(out, state, cfg, fp8_blocks=True, tokenizer_dir=ARITHMETIC_TOKENIZER)


def mtp_layer(cfg, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A multi-token-prediction layer's own tensors where DeepSeek-V3 keeps them (model.layers.{num_layers}.*:
    the norms of the embedding and of the hidden state, their projection, the head's norm); transformers' model
    has none (it skips layers.61), RL does not train it, the export carries it unchanged."""
    h, p = cfg.hidden_size, f"model.layers.{cfg.num_layers}."
    return {p + "enorm.weight": torch.ones(h), p + "hnorm.weight": torch.ones(h),
            p + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
            p + "shared_head.norm.weight": torch.ones(h)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "tiny_deepseek_v3_init")
    args = p.parse_args(argv)
    print(f"wrote {write_checkpoint(args.out / 'checkpoint')}")


if __name__ == "__main__":
    main()
