"""Hugging Face <-> Megatron checkpoint mapping for Qwen3 and Qwen3-MoE (one module, no megatron-bridge).

HF side: the canonical checkpoint layout that SGLang, vLLM and the Hub use (per-expert `mlp.experts.{e}.*`
keys), saved as `model.safetensors` + `config.json`. Megatron side: the `named_parameters()` of this rank's
`GPTModel` (local or TE spec), sharded over tensor parallelism and, for experts, over expert parallelism.

Layout facts the mapping relies on:
- `linear_qkv` rows are grouped per query group g: [q of the g-th group's heads; k_g; v_g]; TP splits groups.
- `linear_fc1` of a SwiGLU MLP is [gate; up] *per TP shard*.
- Row-parallel weights (`linear_proj`, `linear_fc2`) split the input dimension; embeddings and the output
  layer split the vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist

from .config import ModelConfig

HF_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


# ---------------------------------------------------------------------------------------------- configs


def hf_config_dict(cfg: ModelConfig) -> dict:
    """config.json contents of the HF model equivalent to `cfg`."""
    d = {
        "architectures": [HF_ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # what SGLang / vLLM / transformers<5 read
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # transformers>=5
        "attention_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if cfg.is_moe:
        d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                 moe_intermediate_size=cfg.moe_ffn_hidden_size, norm_topk_prob=cfg.moe_norm_topk_prob,
                 decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=cfg.moe_aux_loss_coeff,
                 output_router_logits=False)
    return d


def model_config_from_hf(d: dict) -> ModelConfig:
    """ModelConfig from an HF config.json dict (Qwen3 or Qwen3-MoE)."""
    model_type = d.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; expected one of "
                         f"{', '.join(HF_ARCHITECTURES)}")
    rope = d.get("rope_parameters") or {}
    kw = dict(
        model_type=model_type, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
        num_query_groups=d.get("num_key_value_heads", d["num_attention_heads"]),
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        ffn_hidden_size=d["intermediate_size"], rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 1e6))),
        norm_eps=d.get("rms_norm_eps", 1e-6), max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=d.get("tie_word_embeddings", False),
    )
    if model_type == "qwen3_moe":
        if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
            raise ValueError("config.json: Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step) "
                             "is not supported")
        kw.update(num_experts=d["num_experts"], moe_router_topk=d["num_experts_per_tok"],
                  moe_ffn_hidden_size=d["moe_intermediate_size"], moe_norm_topk_prob=d.get("norm_topk_prob", True),
                  moe_aux_loss_coeff=d.get("router_aux_loss_coef", 1e-3))
    return ModelConfig(**kw)


# model settings that a config may set beside a checkpoint's architecture
NOT_ARCHITECTURE = frozenset({"tokenizer", "moe_aux_loss_coeff"})


def architecture_mismatches(cfg: ModelConfig, ckpt: ModelConfig) -> list[str]:
    """`model.<field>: <cfg value> (checkpoint: <value>)` for every architecture field where the two differ."""
    return [f"model.{f.name}: {getattr(cfg, f.name)!r} (checkpoint: {getattr(ckpt, f.name)!r})"
            for f in fields(ModelConfig) if f.name not in NOT_ARCHITECTURE
            and getattr(cfg, f.name) != getattr(ckpt, f.name)]


# ---------------------------------------------------------------------------------------------- layout helpers


def _ranks():
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())


def _expert_tp():
    """(rank, size) in the expert-tensor-parallel group: experts are split like a dense MLP over it."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()


def _qkv_to_megatron(q, k, v, cfg: ModelConfig):
    """Full HF q [nh*hd, H], k, v [ng*hd, H] -> full megatron linear_qkv [ng*(nh/ng+2)*hd, H]."""
    ng, hd = cfg.num_query_groups, cfg.head_dim
    per = cfg.num_attention_heads // ng
    H = q.shape[1]
    qkv = torch.cat([q.view(ng, per * hd, H), k.view(ng, hd, H), v.view(ng, hd, H)], dim=1)
    return qkv.reshape(-1, H)


def _qkv_from_megatron(qkv, cfg: ModelConfig):
    ng, hd = cfg.num_query_groups, cfg.head_dim
    per = cfg.num_attention_heads // ng
    g = qkv.view(ng, (per + 2) * hd, qkv.shape[1])
    q, k, v = g[:, : per * hd], g[:, per * hd : (per + 1) * hd], g[:, (per + 1) * hd :]
    return (q.reshape(-1, qkv.shape[1]), k.reshape(-1, qkv.shape[1]), v.reshape(-1, qkv.shape[1]))


def _split(t, dim, rank, size):
    return t.chunk(size, dim=dim)[rank].contiguous()


def _layer_map(cfg: ModelConfig, i: int, local: int):
    """(megatron name, hf keys, kind) for global layer i, held as decoder layer `local` of this pipeline stage;
    kind says how the tensor is sharded / combined."""
    m, h = f"decoder.layers.{local}.", f"model.layers.{i}."
    rows = [
        (m + "input_layernorm.weight", [h + "input_layernorm.weight"], "replicated"),
        (m + "self_attention.linear_qkv.weight",
         [h + "self_attn.q_proj.weight", h + "self_attn.k_proj.weight", h + "self_attn.v_proj.weight"], "qkv"),
        (m + "self_attention.q_layernorm.weight", [h + "self_attn.q_norm.weight"], "replicated"),
        (m + "self_attention.k_layernorm.weight", [h + "self_attn.k_norm.weight"], "replicated"),
        (m + "self_attention.linear_proj.weight", [h + "self_attn.o_proj.weight"], "row"),
        (m + "pre_mlp_layernorm.weight", [h + "post_attention_layernorm.weight"], "replicated"),
    ]
    if not cfg.is_moe:
        rows += [
            (m + "mlp.linear_fc1.weight", [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"], "glu"),
            (m + "mlp.linear_fc2.weight", [h + "mlp.down_proj.weight"], "row"),
        ]
    else:
        rows.append((m + "mlp.router.weight", [h + "mlp.gate.weight"], "replicated"))
        for e in range(cfg.num_experts):
            x = f"{h}mlp.experts.{e}."
            rows += [
                (f"{m}mlp.experts.local_experts.{{local}}.linear_fc1.weight#{e}",
                 [x + "gate_proj.weight", x + "up_proj.weight"], "expert_glu"),
                (f"{m}mlp.experts.local_experts.{{local}}.linear_fc2.weight#{e}", [x + "down_proj.weight"], "expert"),
            ]
    return rows


def _mapping(cfg: ModelConfig):
    """The rows of this pipeline stage: the embedding on the first, its layers, the final norm and the output
    layer on the last."""
    from megatron.core import parallel_state as ps

    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    if pp > 1 and cfg.tie_word_embeddings:
        raise NotImplementedError("model.tie_word_embeddings with pipeline parallelism")
    per = cfg.num_layers // pp
    rows = [("embedding.word_embeddings.weight", ["model.embed_tokens.weight"], "vocab")] if stage == 0 else []
    for j in range(per):
        rows += _layer_map(cfg, stage * per + j, j)
    if stage == pp - 1:
        rows.append(("decoder.final_layernorm.weight", ["model.norm.weight"], "replicated"))
        if not cfg.tie_word_embeddings:
            rows.append(("output_layer.weight", ["lm_head.weight"], "vocab"))
    return rows


def _te_name(name: str) -> str:
    """The local-spec parameter name as the TE spec spells it (norms fused into the following linear)."""
    return (name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
            .replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"))


# ---------------------------------------------------------------------------------------------- import


def megatron_state_from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """This rank's megatron parameters (by `named_parameters` name, local spec) from a full HF state dict."""
    tp_rank, tp, ep_rank, ep = _ranks()
    e_local = cfg.num_experts // ep if cfg.is_moe else 0
    out = {}
    for name, keys, kind in _mapping(cfg):
        missing = [k for k in keys if k not in hf]
        if missing:
            raise ValueError(f"HF checkpoint: missing tensor(s) {', '.join(missing)}")
        ts = [hf[k] for k in keys]
        if kind == "replicated":
            out[name] = ts[0]
        elif kind == "vocab":
            out[name] = _split(ts[0], 0, tp_rank, tp)
        elif kind == "row":
            out[name] = _split(ts[0], 1, tp_rank, tp)
        elif kind == "qkv":
            out[name] = _split(_qkv_to_megatron(*ts, cfg), 0, tp_rank, tp)
        elif kind == "glu":
            out[name] = torch.cat([_split(ts[0], 0, tp_rank, tp), _split(ts[1], 0, tp_rank, tp)], dim=0)
        else:  # expert e lives on EP rank e // e_local, split over expert-TP like a dense MLP
            base, e = name.split("#")
            e = int(e)
            if e // e_local != ep_rank:
                continue
            etp_rank, etp = _expert_tp()
            if kind == "expert_glu":
                t = torch.cat([_split(ts[0], 0, etp_rank, etp), _split(ts[1], 0, etp_rank, etp)], dim=0)
            else:
                t = _split(ts[0], 1, etp_rank, etp)
            out[base.format(local=e % e_local)] = t
    return out


@torch.no_grad()
def load_hf_into_model(model: torch.nn.Module, hf: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Copy a full HF state dict into this rank's shards of `model` (every parameter must be covered)."""
    shard = megatron_state_from_hf(hf, cfg)
    params = dict(model.named_parameters())
    unused = set(params)
    for name, t in shard.items():
        key = name if name in params else _te_name(name)
        if key not in params:
            continue  # e.g. the output layer on a pipeline stage that does not hold it
        p = params[key]
        if p.shape != t.shape:
            raise ValueError(f"HF checkpoint: {key} has shape {tuple(t.shape)} for this rank, model expects "
                             f"{tuple(p.shape)}")
        p.copy_(t.to(p.dtype))
        unused.discard(key)
    if unused:
        raise ValueError(f"HF checkpoint: no tensor for model parameter(s) {', '.join(sorted(unused))}")


# ---------------------------------------------------------------------------------------------- export


def _gather(t, group, dim):
    world = dist.get_world_size(group)
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def hf_state_from_model(model: torch.nn.Module, cfg: ModelConfig, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The full HF state dict, gathered over TP, EP and pipeline stages; every rank gets it."""
    from megatron.core import parallel_state as ps

    tp_group, ep_group = ps.get_tensor_model_parallel_group(), ps.get_expert_model_parallel_group()
    etp_group = ps.get_expert_tensor_parallel_group()
    _, _, _, ep = _ranks()
    e_local = cfg.num_experts // ep if cfg.is_moe else 0
    named = {n: p.detach() for n, p in model.named_parameters()}
    params = {}
    for n, *_ in _mapping(cfg):
        if "#" not in n:
            params[n] = named[n] if n in named else named[_te_name(n)]
    params |= {n: p for n, p in named.items() if ".local_experts." in n}
    out = {}
    for name, keys, kind in _mapping(cfg):
        if kind in ("expert", "expert_glu"):
            base, e = name.split("#")
            e = int(e)
            if e >= e_local:
                continue  # one gather per local slot j = e: slot j of EP rank r is global expert r * e_local + j
            local = params[base.format(local=e)]
            if kind == "expert_glu":  # [gate_r; up_r] over expert-TP, like a dense GLU
                gate, up = (_gather(t, etp_group, 0) for t in local.chunk(2, dim=0))
                local = torch.cat([gate, up], dim=0)
            else:
                local = _gather(local, etp_group, 1)
            parts = [torch.empty_like(local) for _ in range(ep)] if ep > 1 else [local]
            if ep > 1:
                dist.all_gather(parts, local.contiguous(), group=ep_group)
            layer = keys[0].split(".mlp.experts.")[0]  # the global layer (base names this stage's local one)
            for r, t in enumerate(parts):
                x = f"{layer}.mlp.experts.{r * e_local + e}."
                if kind == "expert_glu":
                    out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = t.chunk(2, dim=0)
                else:
                    out[x + "down_proj.weight"] = t
            continue
        p = params[name]
        if kind == "replicated":
            ts = [p]
        elif kind == "vocab":
            ts = [_gather(p, tp_group, 0)]
        elif kind == "row":
            ts = [_gather(p, tp_group, 1)]
        elif kind == "qkv":
            ts = list(_qkv_from_megatron(_gather(p, tp_group, 0), cfg))
        else:  # glu: gather [gate_r; up_r] shards, then regroup
            gate, up = p.chunk(2, dim=0)
            ts = [_gather(gate, tp_group, 0), _gather(up, tp_group, 0)]
        for k, t in zip(keys, ts, strict=True):
            out[k] = t
    # copies: the caller may keep the result while training moves the parameters on
    out = {k: v.to(dtype, copy=True).contiguous() for k, v in out.items()}
    pp_group = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp_group) > 1:  # each stage holds its layers: merge the stages' parts
        parts = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, out, group=pp_group)
        out = {k: v for part in parts for k, v in part.items()}
    return out


# ---------------------------------------------------------------------------------------------- files


def save_hf_checkpoint(directory, state: dict[str, torch.Tensor], cfg: ModelConfig, *, extra_config=None,
                       fp8_blocks: bool = False, tokenizer_dir=None) -> Path:
    """Write model.safetensors and config.json atomically enough for a reader polling the directory: both are
    written under temporary names and renamed, config last. fp8_blocks: a block-FP8 checkpoint (each linear
    weight quantized to float8_e4m3fn with 128 x 128 block scales, `quantization_config` in config.json).
    tokenizer_dir: copy its tokenizer files beside the weights (an engine loads the checkpoint's tokenizer)."""
    from safetensors.torch import save_file

    from megatron_pdm.precision import FP8_QUANTIZATION_CONFIG, fp8_block_state

    from .tokenizer import copy_tokenizer_files

    if fp8_blocks:
        state = fp8_block_state(state)
        extra_config = {**(extra_config or {}), "quantization_config": FP8_QUANTIZATION_CONFIG}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(directory / "model.safetensors")
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, directory)
    config = hf_config_dict(cfg) | (extra_config or {})
    ctmp = directory / "config.json.tmp"
    ctmp.write_text(json.dumps(config, indent=2) + "\n")
    ctmp.replace(directory / "config.json")
    return directory


def load_hf_checkpoint(directory) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """(state, config) of an HF checkpoint directory; a block-FP8 one comes back dequantized to float32."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = directory / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config}: no config.json in the HF checkpoint directory")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors files")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    from megatron_pdm.precision import FP8_SCALE_SUFFIX, fp8_block_dequantize_state

    if any(k.endswith(FP8_SCALE_SUFFIX) for k in state):  # block-FP8: the weights an FP8 engine computes with
        state = fp8_block_dequantize_state(state, torch.float32)
    return state, model_config_from_hf(json.loads(config.read_text()))


def canonical_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint keys from transformers>=5's fused in-memory MoE layout
    (`mlp.experts.gate_up_proj` [E, 2I, H] = [gate; up] per expert, `mlp.experts.down_proj` [E, H, I])."""
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            prefix = k[: -len("gate_up_proj")]
            for e, w in enumerate(v):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = w.chunk(2, dim=0)
        elif k.endswith("mlp.experts.down_proj"):
            prefix = k[: -len("down_proj")]
            for e, w in enumerate(v):
                out[f"{prefix}{e}.down_proj.weight"] = w
        else:
            out[k] = v
    return {k: v.contiguous() for k, v in out.items()}
