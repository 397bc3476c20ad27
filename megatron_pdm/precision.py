"""Precision settings for training and rollout, in one place.

training (`train`): fp32; bf16 or fp16 (megatron's mixed-precision optimizer: fp32 main parameters and Adam
states; fp16 needs loss scaling, dynamic unless `loss_scale` is a number); fp8 (Transformer Engine's recipes on
top of bf16: `fp8_recipe` delayed or tensorwise scaling, blockwise, mxfp8 where the TE version has them).
rollout (`rollout`): the dtype the rollout engine computes in: fp32, bf16, fp16, or fp8 (every SGLang engine,
launched by the trainer or by `submit`, starts from a block-FP8 checkpoint, which SGLang serves as FP8 without
--quantization, and gets block-FP8 weights, re-quantized at every weight sync; an engine that quantizes a bf16
checkpoint online, `--quantization fp8`, cannot take weight updates); `kv_cache` is SGLang's --kv-cache-dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pdm._validate import check_choice, check_finite, check_int, is_number

TRAIN = ("fp32", "bf16", "fp16", "fp8")
ROLLOUT = ("fp32", "bf16", "fp16", "fp8")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
KV_CACHE = ("auto", "fp8_e4m3", "fp8_e5m2")
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class PrecisionConfig:
    """The trainer's and the rollout engines' number formats (the module docstring says what each one runs)."""

    # the trainer's dtype: fp32, bf16, fp16 (both with fp32 main weights and Adam states) or fp8 (TE on top of bf16)
    train: str = "fp32"
    rollout: str = "fp32"  # the rollout engine's dtype: fp32, bf16, fp16 or fp8 (block-FP8, re-quantized each sync)
    fp8_recipe: str = "delayed"  # Transformer Engine's FP8 recipe with train fp8: delayed, tensorwise, blockwise, mxfp8
    loss_scale: str | float = "dynamic"  # fp16: "dynamic" or a fixed positive scale; "none" for fp32 / bf16
    kv_cache: str = "auto"  # SGLang's --kv-cache-dtype: auto (the model's dtype), fp8_e4m3 or fp8_e5m2

    def __post_init__(self):
        check_finite("precision", self)
        for name, allowed in (("train", TRAIN), ("rollout", ROLLOUT), ("fp8_recipe", FP8_RECIPES),
                              ("kv_cache", KV_CACHE)):
            check_choice(f"precision.{name}", getattr(self, name), allowed)
        s = self.loss_scale
        if not (s in ("dynamic", "none") or (is_number(s) and s > 0)):
            raise ValueError(f"precision.loss_scale: {s!r}: expected 'dynamic', 'none' or a positive number")
        if self.train == "fp16" and s == "none":
            raise ValueError("precision.loss_scale: 'none' with precision.train fp16: fp16 gradients underflow "
                             "without loss scaling; use 'dynamic' or a fixed scale")

    @property
    def bf16(self) -> bool:
        """megatron's bf16 flag: bf16 weights, also under fp8 (TE casts to fp8 inside its GEMMs)."""
        return self.train in ("bf16", "fp8")

    @property
    def fp16(self) -> bool:
        return self.train == "fp16"

    def check_hardware(self, *, cuda: bool, transformer_engine: bool) -> None:
        """Raise for a setting this machine cannot run (never fall back silently)."""
        if self.train == "fp8" and not (cuda and transformer_engine):
            raise ValueError("precision.train: 'fp8' needs CUDA and Transformer Engine (this machine has "
                             f"cuda={cuda}, transformer_engine={transformer_engine})")


INITIAL_LOSS_SCALE = 2.0**16  # fp16's first dynamic scale: megatron's default 2**32 skips the first ~16 steps


def megatron_model_settings(prec: PrecisionConfig) -> dict:
    """The TransformerConfig keyword arguments of `prec.train` (for `models.build_model`, which also takes them):
    params_dtype (torch.float32 for fp32, float16 for fp16, bfloat16 for bf16 and fp8), the bf16 / fp16 flags, and
    under fp8 `fp8="e4m3"` (e4m3 in the forward and backward GEMMs) with `fp8_recipe`.

        fp32  {params_dtype: float32,  bf16: False, fp16: False}
        bf16  {params_dtype: bfloat16, bf16: True,  fp16: False}
        fp16  {params_dtype: float16,  bf16: False, fp16: True}
        fp8   {params_dtype: bfloat16, bf16: True,  fp16: False, fp8: "e4m3", fp8_recipe: prec.fp8_recipe}
    """
    import torch

    dtype = getattr(torch, TORCH_DTYPE_NAMES.get(prec.train, "bfloat16"))  # fp8: bf16 weights
    out = dict(params_dtype=dtype, bf16=prec.bf16, fp16=prec.fp16)
    if prec.train == "fp8":
        out.update(fp8="e4m3", fp8_recipe=prec.fp8_recipe)
    return out


def megatron_optimizer_settings(prec: PrecisionConfig) -> dict:
    """The OptimizerConfig keyword arguments of `prec`: params_dtype, bf16 and fp16 as in `megatron_model_settings`,
    loss_scale (a fixed float scale, or None: dynamic loss scaling under fp16, no scaling under fp32 / bf16 / fp8)
    and initial_loss_scale (INITIAL_LOSS_SCALE, the first dynamic scale)."""
    model = megatron_model_settings(prec)
    fixed = prec.loss_scale not in ("dynamic", "none")
    return dict(params_dtype=model["params_dtype"], bf16=model["bf16"], fp16=model["fp16"],
                loss_scale=float(prec.loss_scale) if fixed else None, initial_loss_scale=INITIAL_LOSS_SCALE)


def rollout_engine_dtype(rollout: str) -> tuple[str, str | None]:
    """(dtype, quantization) of a rollout engine, as SGLang's --dtype / --quantization take them: fp8 computes in
    bf16 on fp8 weights."""
    return ("bfloat16", "fp8") if rollout == "fp8" else (TORCH_DTYPE_NAMES[rollout], None)


FP8_BLOCK = 128  # DeepSeek-V3 / SGLang block-FP8 checkpoints: one scale per 128 x 128 block of a weight


FP8_QUANTIZE_CHUNK_BYTES = 32 << 20  # float32 rows that one step of fp8_block_quantize works on


def fp8_block_quantize(w, block: int = FP8_BLOCK, chunk_bytes: int = FP8_QUANTIZE_CHUNK_BYTES):
    """w [..., N, M] -> (q float8_e4m3fn [..., N, M], scales float32 [..., ceil(N/b), ceil(M/b)]) with
    scale = amax(|block|) / 448 (e4m3's largest finite value), q = round_to_e4m3(w / scale). Leading dims are
    batched (fused MoE experts). An all-zero block gets scale 1. Blocks are independent, so it runs over row blocks
    of about `chunk_bytes` of float32 at a time (the same bits as one pass): beyond q and the scales, allocated once
    on w's device, its temporaries (a float32 copy, padded, |x|, the quotient) stay under 3 x chunk_bytes whatever
    the size of w (a whole weight quantized on a TP-1 sender)."""
    import math

    import torch

    *lead, n, m = w.shape
    rows = max(1, chunk_bytes // (4 * max(m, 1) * max(math.prod(lead), 1)) // block) * block
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty((*lead, -(-n // block), -(-m // block)), dtype=torch.float32, device=w.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        q[..., r0:r1, :], scales[..., r0 // block : -(-r1 // block), :] = _fp8_quantize_rows(w[..., r0:r1, :], block)
    return q, scales


def _fp8_quantize_rows(w, block: int):
    """`fp8_block_quantize` of rows that start at a block boundary, in one pass."""
    import torch

    *lead, n, m = w.shape
    pn, pm = -n % block, -m % block
    x = torch.nn.functional.pad(w.float(), (0, pm, 0, pn))
    x = x.reshape(*lead, (n + pn) // block, block, (m + pm) // block, block)
    amax = x.abs().amax(dim=(-3, -1))
    scales = torch.where(amax > 0, amax / torch.finfo(torch.float8_e4m3fn).max, torch.ones_like(amax))
    q = (x / scales[..., :, None, :, None]).to(torch.float8_e4m3fn)
    return q.reshape(*lead, n + pn, m + pm)[..., :n, :m], scales


def fp8_block_dequantize(q, scales, dtype, block: int = FP8_BLOCK):
    """The inverse of `fp8_block_quantize`: q * scale of its block, in `dtype`."""
    import torch

    s = scales.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return (q.to(torch.float32) * s[..., : q.shape[-2], : q.shape[-1]]).to(dtype)


# A block-FP8 HF checkpoint (DeepSeek-V3 / Qwen3-FP8 layout, which SGLang loads natively): every linear weight as
# float8_e4m3fn beside `<name>_scale_inv` (its per-block dequantization scales), the rest in their dtype.
FP8_UNQUANTIZED = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
FP8_SCALE_SUFFIX = "_scale_inv"


def fp8_quantizable(name: str, w) -> bool:
    """Linear weights: not the embeddings, the output layer, the norms or the MoE router."""
    return w.dim() >= 2 and fp8_quantizable_name(name)


def fp8_quantizable_name(name: str) -> bool:
    """What the name alone says of `fp8_quantizable` (1-D tensors, biases, are not either)."""
    return not any(part in name for part in FP8_UNQUANTIZED)


def fp8_block_state(state: dict) -> dict:
    """{name: w} -> the block-FP8 checkpoint tensors: q (float8_e4m3fn) at `name` and scales at
    `name + "_scale_inv"` for each quantizable weight, in order; w = q * scale of its block. Entries already
    quantized (a float8 q, its scales) pass through."""
    import torch

    out = {}
    for name, w in state.items():
        done = w.dtype == torch.float8_e4m3fn or name.endswith(FP8_SCALE_SUFFIX)  # quantized before (the sender)
        if fp8_quantizable(name, w) and not done:
            out[name], out[name + FP8_SCALE_SUFFIX] = fp8_block_quantize(w)
        else:
            out[name] = w
    return out


def _fp8_layers(cfg, tp: int) -> list[tuple[str, str, int, bool]]:
    """(layer, what, size, merged) for every linear weight dim that SGLang checks against the FP8 block at engine TP
    `tp`: the output dims of column-parallel layers, the input dims of row-parallel ones, each split over the TP
    ranks. `merged`: part of a merged layer (q/k/v as qkv_proj, gate/up as gate_up_proj) or of the routed
    experts, which SGLang checks at every TP; the others only when split (tp > 1)."""
    layers, moe = "model.layers.*", cfg.num_experts > 0
    out = []
    if cfg.model_type == "deepseek_v3":  # multi-latent attention; fused_qkv_a_proj_with_mqa is replicated
        nh, qk = cfg.num_attention_heads, cfg.head_dim + cfg.qk_rope_head_dim
        q = "q_b_proj" if cfg.q_lora_rank else "q_proj"
        out += [(f"{layers}.self_attn.{q}", "output (heads x qk head dim)", nh * qk, False),
                (f"{layers}.self_attn.kv_b_proj", "output (heads x (qk + v head dim))",
                 nh * (cfg.head_dim + cfg.v_head_dim), False),
                (f"{layers}.self_attn.o_proj", "input (heads x v head dim)", nh * cfg.v_head_dim, False)]
        dense = cfg.moe_first_k_dense > 0
    else:  # GQA: q, k, v merged into SGLang's qkv_proj; key-value heads replicated when TP exceeds their number
        kv = cfg.head_dim * max(1, cfg.num_query_groups // tp) * tp
        out += [(f"{layers}.self_attn.q_proj", "output (heads x head dim)", cfg.num_attention_heads * cfg.head_dim,
                 True),
                (f"{layers}.self_attn.k_proj/v_proj", "output (key-value heads x head dim, per rank x TP)", kv, True),
                (f"{layers}.self_attn.o_proj", "input (heads x head dim)", cfg.num_attention_heads * cfg.head_dim,
                 False)]
        dense = not moe
    if dense:
        out += [(f"{layers}.mlp.gate_proj/up_proj", "output (ffn_hidden_size)", cfg.ffn_hidden_size, True),
                (f"{layers}.mlp.down_proj", "input (ffn_hidden_size)", cfg.ffn_hidden_size, False)]
    if moe:
        out += [(f"{layers}.mlp.experts.*.gate_proj/up_proj", "output (moe_ffn_hidden_size)", cfg.moe_ffn_hidden_size,
                 True),
                (f"{layers}.mlp.experts.*.down_proj", "input (moe_ffn_hidden_size)", cfg.moe_ffn_hidden_size, True)]
        if cfg.moe_shared_expert_ffn_hidden_size:
            s = cfg.moe_shared_expert_ffn_hidden_size
            out += [(f"{layers}.mlp.shared_experts.gate_proj/up_proj", "output (moe_shared_expert_ffn_hidden_size)",
                     s, True),
                    (f"{layers}.mlp.shared_experts.down_proj", "input (moe_shared_expert_ffn_hidden_size)", s, False)]
    return out


def _fp8_refusal(cfg, tp: int, block: int) -> str | None:
    for layer, what, size, merged in _fp8_layers(cfg, tp):
        if size % tp:
            return f"{layer}: {what} {size} does not split over engine TP {tp}"
        if (size // tp) % block and (merged or tp > 1):
            return (f"{layer}: {what} {size} / engine TP {tp} = {size // tp} per shard is not a multiple of the "
                    f"{block} x {block} FP8 block")
    return None


def fp8_block_shape_error(cfg, engine_tp: int, block: int = FP8_BLOCK) -> str | None:
    """None when SGLang can load `cfg` (a ModelConfig) as block-FP8 at engine TP `engine_tp`; else a message naming
    the first layer it refuses. SGLang (0.5.23, layers/quantization/fp8.py: Fp8LinearMethod.validate_block_quant_
    shapes and Fp8MoEMethod.create_weights) requires every per-TP-shard output dim of a column-parallel layer and
    input dim of a row-parallel one to be a multiple of the 128 x 128 block, at every TP for merged layers (q/k/v,
    gate/up) and the routed experts, else when split (TP > 1): e.g. Qwen3-30B-A3B's experts (moe_ffn_hidden_size
    768) at engine TP 8 are 96-wide shards, which it refuses (at TP 4 too: 192). Experts are assumed TP-sharded
    (no expert parallelism in the engine)."""
    check_int("engine TP", engine_tp)
    error = _fp8_refusal(cfg, engine_tp, block)
    if error is None:
        return None
    good = [t for t in (1, 2, 4, 8, 16) if _fp8_refusal(cfg, t, block) is None]
    return (f"{error}, which SGLang refuses to load (engine TPs that work: "
            f"{', '.join(map(str, good)) or 'none of 1, 2, 4, 8, 16'})")


def check_fp8_block_shapes(cfg, engine_tp: int, field: str = "rollout.sglang.engine_tp") -> None:
    """ValueError naming `field`, the layer and the engine TP when SGLang cannot serve `cfg` as block-FP8 there."""
    error = fp8_block_shape_error(cfg, engine_tp)
    if error:
        raise ValueError(f"{field}: {engine_tp} with precision.rollout fp8: {error}")
