"""Hugging Face <-> Megatron checkpoint mapping for Qwen3 and Qwen3-MoE (one module, no megatron-bridge).

HF side: the canonical checkpoint layout that SGLang, vLLM and the Hub use (per-expert `mlp.experts.{e}.*`
keys), saved as `model.safetensors` + `config.json`. Megatron side: the `named_parameters()` of this rank's
`GPTModel` (local or TE spec), sharded over tensor parallelism and, for experts, over expert parallelism; with
virtual pipeline stages, of each of its model chunks (a list of GPTModels; every function here takes either).

Layout facts the mapping relies on:
- `linear_qkv` rows are grouped per query group g: [q of the g-th group's heads; k_g; v_g]; TP splits groups.
- `linear_fc1` of a SwiGLU MLP is [gate; up] *per TP shard*.
- Row-parallel weights (`linear_proj`, `linear_fc2`) split the input dimension; embeddings and the output
  layer split the vocabulary.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_pdm._jsonl import write_atomic
from megatron_pdm.precision import FP8_BLOCK, FP8_SCALE_SUFFIX, fp8_block_quantize, fp8_quantizable

from .config import MODEL_TYPE_ALIASES, ROPE_SCALINGS, ModelConfig
from .families import FAMILIES, layer_tensors, model_tensors
from .gpt import model_chunks
from .parallel import ParallelContext

log = logging.getLogger(__name__)

HF_ARCHITECTURES = {t: f.hf_architecture for t, f in FAMILIES.items()}


# ---------------------------------------------------------------------------------------------- configs


def _rope_dict(cfg: ModelConfig) -> dict | None:
    """The rope scaling block as config.json spells it (None without scaling)."""
    if cfg.rope_scaling == "llama3":
        return {"rope_type": "llama3", "factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position_embeddings}
    if cfg.rope_scaling == "yarn":
        return {"rope_type": "yarn", "factor": cfg.rope_scaling_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position_embeddings,
                "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow, "mscale": cfg.rope_mscale,
                "mscale_all_dim": cfg.rope_mscale_all_dim}
    return None


def hf_config_dict(cfg: ModelConfig) -> dict:
    """config.json contents of the HF model equivalent to `cfg`."""
    rope = _rope_dict(cfg)
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
        "rope_theta": cfg.rope_theta,  # what SGLang / vLLM / transformers<5 read, with rope_scaling
        "rope_scaling": rope,
        "rope_parameters": {"rope_type": "default", **(rope or {}), "rope_theta": cfg.rope_theta},  # transformers>=5
        "attention_bias": cfg.qkv_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if cfg.model_type == "qwen3_moe":
        d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                 moe_intermediate_size=cfg.moe_ffn_hidden_size, norm_topk_prob=cfg.moe_norm_topk_prob,
                 decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=cfg.moe_aux_loss_coeff,
                 output_router_logits=False)
    elif cfg.model_type == "qwen2":
        d.update(use_sliding_window=False, sliding_window=None)
        del d["head_dim"], d["attention_bias"]  # Qwen2: hidden_size / heads, and always a q / k / v bias
    elif cfg.model_type == "llama":
        d.update(mlp_bias=False)
    elif cfg.model_type == "deepseek_v3":
        groups = cfg.moe_router_num_groups or 1
        d.update(head_dim=cfg.qk_rope_head_dim, qk_nope_head_dim=cfg.head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                 v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
                 rope_interleave=True, n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                 moe_intermediate_size=cfg.moe_ffn_hidden_size,
                 n_shared_experts=cfg.moe_shared_expert_ffn_hidden_size // cfg.moe_ffn_hidden_size,
                 first_k_dense_replace=cfg.moe_first_k_dense, moe_layer_freq=1, n_group=groups,
                 topk_group=cfg.moe_router_group_topk or groups, routed_scaling_factor=cfg.moe_routed_scaling_factor,
                 norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
                 num_nextn_predict_layers=cfg.mtp_num_layers)
    return d


def _rope_from_hf(d: dict, model_type: str) -> dict:
    """ModelConfig's rope fields from config.json: `rope_parameters` (transformers>=5) or the legacy `rope_theta`
    + `rope_scaling` (`type` or `rope_type`), as the released DeepSeek-V3 / Kimi-K2 / Llama-3 files spell it."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if params.get("rope_type", "default") != "default" or not scaling:
        scaling = params
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    out = {"rope_theta": float(d.get("rope_theta") or params.get("rope_theta") or 1e4)}
    if kind == "default":
        return out
    allowed = [k for k, types in ROPE_SCALINGS.items() if k != "none" and model_type in types]
    if kind not in allowed:
        raise ValueError(f"config.json: rope scaling {kind!r} with model_type {model_type!r} is not supported"
                         + (f" (supported: {', '.join(allowed)})" if allowed else ""))
    out.update(rope_scaling=kind, rope_scaling_factor=float(scaling["factor"]),
               rope_original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                   rope_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)))
    else:  # transformers' YaRN defaults where a key is absent
        out.update(rope_beta_fast=float(scaling.get("beta_fast") or 32), rope_beta_slow=float(scaling.get("beta_slow")
                   or 1), rope_mscale=float(scaling.get("mscale") or 1), rope_mscale_all_dim=float(
                   scaling.get("mscale_all_dim") or 0))
    return out


# transformers' names (ACT2FN) of SiLU, the gated MLP's activation in every family here; absent, each family's
# config class defaults to "silu"
SILU_NAMES = ("silu", "swish")
# transformers' norm_topk_prob where config.json has none: Qwen3MoeConfig's False (the top-k softmax weights
# are not renormalised), DeepseekV3Config's True
NORM_TOPK_PROB_DEFAULT = {"qwen3_moe": False, "deepseek_v3": True}


def _norm_topk_prob(d: dict, model_type: str) -> bool:
    """Whether the router renormalises its top-k weights: config.json's norm_topk_prob, else transformers'."""
    return d.get("norm_topk_prob", NORM_TOPK_PROB_DEFAULT[model_type])


def _check_hf_layers(d: dict, model_type: str) -> None:
    """ValueError naming the key and its value for layers this builder would compute differently: an activation
    other than SiLU (the model's MLP is always a SiLU GLU), Qwen3's q / k / v biases (it builds none)."""
    act = d.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (the {model_type} MLP is a SiLU GLU: "
                         "hidden_act 'silu')")
    if model_type in ("qwen3", "qwen3_moe") and d.get("attention_bias"):
        raise ValueError(f"config.json: attention_bias {json.dumps(d['attention_bias'])} (Qwen3 with q / k / v "
                         "biases) is not supported")


def model_config_from_hf(d: dict) -> ModelConfig:
    """ModelConfig from an HF config.json dict (Qwen3, Qwen3-MoE, Qwen2, Llama, DeepSeek-V3 / Kimi-K2). ValueError
    naming the key for an architecture this builder would compute differently. A key config.json leaves out takes
    transformers' default for the model type."""
    model_type = MODEL_TYPE_ALIASES.get(d.get("model_type"), d.get("model_type"))
    if model_type not in HF_ARCHITECTURES:
        raise ValueError(f"config.json: model_type {d.get('model_type')!r} is not supported; expected one of "
                         f"{', '.join(HF_ARCHITECTURES)} (or {', '.join(MODEL_TYPE_ALIASES)})")
    _check_hf_layers(d, model_type)
    kw = dict(
        model_type=model_type, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
        num_query_groups=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        ffn_hidden_size=d["intermediate_size"], norm_eps=d.get("rms_norm_eps", 1e-6),
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=d.get("tie_word_embeddings", False), **_rope_from_hf(d, model_type),
    )
    if model_type == "qwen3_moe":
        if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
            raise ValueError("config.json: Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step) "
                             "is not supported")
        kw.update(num_experts=d["num_experts"], moe_router_topk=d["num_experts_per_tok"],
                  moe_ffn_hidden_size=d["moe_intermediate_size"], moe_norm_topk_prob=_norm_topk_prob(d, "qwen3_moe"),
                  moe_aux_loss_coeff=d.get("router_aux_loss_coef", 1e-3))
    elif model_type == "qwen2":
        if d.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window true (Qwen2 sliding-window attention) is not supported")
        kw["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    elif model_type == "llama":
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise ValueError(f"config.json: {key} true (Llama with biases) is not supported")
    elif model_type == "deepseek_v3":
        kw.update(_deepseek_v3_from_hf(d))
    return ModelConfig(**kw)


def _deepseek_v3_from_hf(d: dict) -> dict:
    if d.get("scoring_func", "sigmoid") != "sigmoid" or d.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"config.json: scoring_func {d.get('scoring_func')!r} / topk_method {d.get('topk_method')!r}"
                         ": only DeepSeek-V3's sigmoid scores with the expert bias (noaux_tc) are supported")
    if d.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"config.json: moe_layer_freq {d['moe_layer_freq']} (only 1: every layer after the first "
                         "first_k_dense_replace routes)")
    if d.get("attention_bias"):
        raise ValueError("config.json: attention_bias true is not supported for DeepSeek-V3")
    groups = d.get("n_group") or 1
    return dict(
        head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
        q_lora_rank=d.get("q_lora_rank") or 0, kv_lora_rank=d["kv_lora_rank"],
        num_query_groups=d["num_attention_heads"], num_experts=d["n_routed_experts"],
        moe_router_topk=d["num_experts_per_tok"], moe_ffn_hidden_size=d["moe_intermediate_size"],
        moe_shared_expert_ffn_hidden_size=(d.get("n_shared_experts") or 0) * d["moe_intermediate_size"],
        moe_first_k_dense=d.get("first_k_dense_replace", 0), moe_norm_topk_prob=_norm_topk_prob(d, "deepseek_v3"),
        moe_router_num_groups=groups if groups > 1 else 0,
        moe_router_group_topk=(d.get("topk_group") or groups) if groups > 1 else 0,
        moe_routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        moe_aux_loss_coeff=0.0,  # RL: no balance loss (slime, mbridge); model.moe_aux_loss_coeff sets one
        mtp_num_layers=d.get("num_nextn_predict_layers", 0) or 0,
    )


# model settings that a config may set beside a checkpoint's architecture
NOT_ARCHITECTURE = frozenset({"tokenizer", "moe_aux_loss_coeff", "moe_router_bias_update_rate",
                              "moe_token_dispatcher_type", "moe_enable_deepep", "moe_grouped_gemm"})


def architecture_mismatches(cfg: ModelConfig, ckpt: ModelConfig) -> list[str]:
    """`model.<field>: <cfg value> (checkpoint: <value>)` for every architecture field where the two differ."""
    return [f"model.{f.name}: {getattr(cfg, f.name)!r} (checkpoint: {getattr(ckpt, f.name)!r})"
            for f in fields(ModelConfig) if f.name not in NOT_ARCHITECTURE
            and getattr(cfg, f.name) != getattr(ckpt, f.name)]


# ---------------------------------------------------------------------------------------------- layout helpers


def _qkv_to_megatron(q, k, v, cfg: ModelConfig):
    """Full HF q [nh*hd, ...], k, v [ng*hd, ...] -> full megatron linear_qkv [ng*(nh/ng+2)*hd, ...] (weights [.., H]
    or biases)."""
    ng, hd = cfg.num_query_groups, cfg.head_dim
    per = cfg.num_attention_heads // ng
    rest = q.shape[1:]
    qkv = torch.cat([q.view(ng, per * hd, *rest), k.view(ng, hd, *rest), v.view(ng, hd, *rest)], dim=1)
    return qkv.reshape(-1, *rest)


def _qkv_from_megatron(qkv, cfg: ModelConfig, groups: int | None = None):
    """Megatron linear_qkv [g*(nh/ng+2)*hd, ...] of `groups` query groups (default: all ng; a TP shard holds ng / tp
    consecutive ones) -> HF (q [g*(nh/ng)*hd, ...], k [g*hd, ...], v [g*hd, ...]): for a TP shard, contiguous row
    blocks of the full q, k, v."""
    hd, per = cfg.head_dim, cfg.num_attention_heads // cfg.num_query_groups
    rest = qkv.shape[1:]
    g = qkv.view(groups or cfg.num_query_groups, (per + 2) * hd, *rest)
    q, k, v = g[:, : per * hd], g[:, per * hd : (per + 1) * hd], g[:, (per + 1) * hd :]
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _split(t, dim, rank, size):
    return t.chunk(size, dim=dim)[rank].contiguous()


def _rows(tensors, m: str, h: str) -> list:
    return [(m + t.megatron, [h + x for x in t.hf], t.kind) for t in tensors]


def _layer_map(cfg: ModelConfig, i: int, local: int):
    """(megatron name, hf keys, kind) for global layer i, held as decoder layer `local` of this pipeline stage;
    kind says how the tensor is sharded / combined (the family's tensor list, `families.layer_tensors`)."""
    return _rows(layer_tensors(cfg, i), f"decoder.layers.{local}.", f"model.layers.{i}.")


def _named_weights(chunk) -> dict[str, torch.Tensor]:
    """A chunk's parameters and the buffers that a checkpoint holds (DeepSeek-V3's router expert bias)."""
    return dict(chunk.named_parameters()) | {n: b for n, b in chunk.named_buffers()
                                             if n.endswith(".router.expert_bias")}


def export_dtype(key: str, dtype):
    """The dtype a weight is exported and synced in: `dtype` (or `dtype(key)` when it is a function of the key),
    except the expert bias, kept in float32 as the checkpoints and the engines keep it (a bf16 bias would move
    routing decisions)."""
    if key.endswith("e_score_correction_bias"):
        return torch.float32
    return dtype(key) if callable(dtype) else dtype


def _mapping(cfg: ModelConfig, layers: range, *, first: bool, last: bool):
    """The rows of a model chunk holding the global decoder layers `layers`: the embedding when it is the first
    chunk of the model (`first`), its layers, the final norm and the output layer when it is the last (`last`). A
    tied embedding on a last chunk that is not also the first (pipeline parallelism) is megatron's copy of the first
    stage's embedding, `output_layer.weight`: its row, of kind "tied_copy", imports model.embed_tokens.weight like
    the embedding and is never exported (the first stage exports the one tensor)."""
    head, tail = model_tensors(cfg, first=first, last=last)
    rows = _rows(head, "", "")
    for j, i in enumerate(layers):
        rows += _layer_map(cfg, i, j)
    rows += _rows(tail, "", "")
    if last and cfg.tie_word_embeddings and not first:
        rows.append(("output_layer.weight", ["model.embed_tokens.weight"], "tied_copy"))
    return rows


def _exported(mapping: list) -> list:
    """The rows of a mapping that an export emits: all but a tied embedding's last-stage copy."""
    return [row for row in mapping if row[2] != "tied_copy"]


def _chunk_mappings(model, cfg: ModelConfig, ctx: ParallelContext) -> list[tuple[torch.nn.Module, list]]:
    """(chunk, its `_mapping` rows) for every model chunk of this rank, in chunk order."""
    chunks = model_chunks(model)
    vps = [None] if len(chunks) == 1 else range(len(chunks))
    return [(chunk, _mapping(cfg, layers, first=ctx.is_first_stage(vp), last=ctx.is_last_stage(vp)))
            for chunk, layers, vp in zip(chunks, ctx.chunk_layers(cfg.num_layers), vps, strict=True)]


_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def _te_name(name: str) -> str:
    """The local-spec parameter name as the TE spec spells it (norms fused into the following linear; under
    model.moe_grouped_gemm, local expert j's weight as the j-th GEMM's of TE's grouped linear, the same tensor)."""
    return (_LOCAL_EXPERT.sub(r"mlp.experts.\2.weight\1", name)
            .replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
            .replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
            .replace("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight")
            .replace("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight"))


def _param(named: dict, name: str):
    """named[name], or under the TE spec's spelling of it (`_te_name`)."""
    return named[name] if name in named else named[_te_name(name)]


# ---------------------------------------------------------------------------------------------- import


def megatron_state_from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig, rows: list, ctx: ParallelContext
                           ) -> dict[str, torch.Tensor]:
    """This rank's megatron parameters of a model chunk (by `named_parameters` name, local spec) from a full HF state
    dict; rows: the chunk's mapping (`_chunk_mappings`)."""
    tp_rank, tp, ep_rank, ep = ctx.tp_rank, ctx.tp, ctx.ep_rank, ctx.ep
    e_local = cfg.num_experts // ep if cfg.is_moe else 0
    out = {}
    for name, keys, kind in rows:
        missing = [k for k in keys if k not in hf]
        if missing:
            raise ValueError(f"HF checkpoint: missing tensor(s) {', '.join(missing)}")
        if kind in ("expert", "expert_glu") and int(name.split("#")[1]) // e_local != ep_rank:
            continue  # another EP rank's expert: never read here
        ts = [hf[k] for k in keys]
        if kind == "replicated":
            out[name] = ts[0]
        elif kind in ("vocab", "col", "tied_copy"):
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
            etp_rank, etp = ctx.etp_rank, ctx.etp
            if kind == "expert_glu":
                t = torch.cat([_split(ts[0], 0, etp_rank, etp), _split(ts[1], 0, etp_rank, etp)], dim=0)
            else:
                t = _split(ts[0], 1, etp_rank, etp)
            out[base.format(local=e % e_local)] = t
    return out


@torch.no_grad()
def load_hf_into_model(model, hf: dict[str, torch.Tensor], cfg: ModelConfig, ctx: ParallelContext) -> None:
    """Copy a full HF state dict into this rank's shards of `model` (a GPTModel or a list of model chunks; every
    parameter must be covered). A tied embedding goes into the first stage's embedding and, under pipeline
    parallelism, into the last stage's copy of it too."""
    for chunk, rows in _chunk_mappings(model, cfg, ctx):
        params = _named_weights(chunk)
        unused = set(params)
        for name, t in megatron_state_from_hf(hf, cfg, rows, ctx).items():
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
def hf_state_from_model(model, cfg: ModelConfig, ctx: ParallelContext, dtype=torch.float32
                        ) -> dict[str, torch.Tensor]:
    """The full HF state dict, gathered over TP, EP and pipeline stages; every rank gets it. Memory: the whole model
    in `dtype` on every rank (and, under pipeline parallelism, its pickled copy); for exports and tests. Weight syncs
    go through `hf_buckets_from_model`, which holds one bucket on one rank per stage."""
    g, ep = ctx.groups, ctx.ep
    e_local = cfg.num_experts // ep if cfg.is_moe else 0
    out = {}
    for chunk, mapping in _chunk_mappings(model, cfg, ctx):
        out |= _hf_state_of_chunk(chunk, _exported(mapping), cfg, g.tp, g.ep, g.expt_tp, e_local, ep)
    # copies: the caller may keep the result while training moves the parameters on
    out = {k: v.to(export_dtype(k, dtype), copy=True).contiguous() for k, v in out.items()}
    pp_group = ctx.pp_group
    if ctx.pp > 1:  # each stage holds its layers: merge the stages' parts
        parts = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, out, group=pp_group)
        out = {k: v for part in parts for k, v in part.items()}
    return out


def _hf_state_of_chunk(chunk, mapping, cfg: ModelConfig, tp_group, ep_group, etp_group, e_local: int, ep: int
                       ) -> dict[str, torch.Tensor]:
    """The HF tensors of one model chunk, gathered over TP, expert-TP and EP (`hf_state_from_model`)."""
    named = {n: p.detach() for n, p in _named_weights(chunk).items()}
    params = {}
    for n, *_ in mapping:
        if "#" not in n:
            params[n] = _param(named, n)
    out = {}
    for name, keys, kind in mapping:
        if kind in ("expert", "expert_glu"):
            base, e = name.split("#")
            e = int(e)
            if e >= e_local:
                continue  # one gather per local slot j = e: slot j of EP rank r is global expert r * e_local + j
            local = _param(named, base.format(local=e))
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
        elif kind in ("vocab", "col"):
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
    return out


# ---------------------------------------------------------------------------------------------- bucketed export

DEFAULT_BUCKET_BYTES = 1 << 30  # the weight sync's bucket (rollout.sync_bucket_bytes)


def _gather_stack(t: torch.Tensor, group) -> torch.Tensor | None:
    """The group's shards of `t` stacked [world, *shape] in group-rank order on the group's first rank (None on the
    others): one dist.gather, world x shard bytes received into one fresh buffer."""
    t = t.contiguous()
    world = dist.get_world_size(group)
    if world == 1:
        return t[None]
    first = dist.get_rank(group) == 0
    buf = torch.empty((world, *t.shape), dtype=t.dtype, device=t.device) if first else None
    dist.gather(t, list(buf.unbind(0)) if first else None, group=group, group_dst=0)
    return buf


def _gather_first(t: torch.Tensor, group, dim: int) -> torch.Tensor | None:
    """The full tensor (shards concatenated along `dim`) on the group's first rank, None on the others. Transient
    memory there: the full tensor, twice when dim > 0 (the gather buffer and its concatenation)."""
    buf = _gather_stack(t, group)
    if buf is None:
        return None
    return buf.reshape(-1, *t.shape[1:]) if dim == 0 else torch.cat(buf.unbind(0), dim=dim)


def _narrowed(p: torch.Tensor, dtype) -> torch.Tensor:
    """A shard in `dtype` before it is gathered when that is narrower (bf16 from fp32: half the bytes gathered and
    held); as it is otherwise (widened after the gather). Rounding per element: the same values either way."""
    return p.to(dtype) if dtype.itemsize < p.element_size() else p


def _owned(t: torch.Tensor, param: torch.Tensor, dtype) -> torch.Tensor:
    """`t` in `dtype`, contiguous, never sharing memory with the parameter (training moves it on)."""
    shares = t.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
    return t.to(dtype, copy=shares).contiguous()


@dataclass(frozen=True)
class _ExportItem:
    """One megatron parameter (or one expert slot over EP) of this stage: its full size in elements, whether it is
    an expert's, `fetch(dtype)`, which runs its gathers and returns [(hf key, tensor)] (empty off the first rank of
    the gathers), and fp8_bytes: its size as block-FP8 pairs when it is exported so (`_fp8_exported`), else 0."""

    numel: int
    expert: bool
    fetch: object
    fp8_bytes: int = 0


def _dense_tensors(p, kind: str, keys: list[str], cfg: ModelConfig, g, dtype, fp8: bool = False
                   ) -> list[tuple[str, torch.Tensor]]:
    """The full HF tensors of a dense parameter, gathered over TP (g) onto its first rank (empty elsewhere); fp8:
    as block-FP8 pairs (`_dense_fp8`)."""
    if fp8:
        return _dense_fp8(p, kind, keys, cfg, g)
    src = _narrowed(p, export_dtype(keys[0], dtype))
    if kind == "replicated":
        ts = [src]
    elif kind in ("vocab", "col", "row"):
        ts = [_gather_first(src, g, 1 if kind == "row" else 0)]
    elif kind == "qkv":
        full = _gather_first(src, g, 0)
        ts = [None] if full is None else list(_qkv_from_megatron(full, cfg))
    else:  # glu: [gate_r; up_r] per TP shard
        ts = [_gather_first(x, g, 0) for x in src.chunk(2, dim=0)]
    if any(t is None for t in ts):
        return []
    return [(k, _owned(t, p, export_dtype(k, dtype))) for k, t in zip(keys, ts, strict=True)]


def _expert_tensors(p, kind: str, layer: str, slot: int, e_local: int, etp_group, ep_group, dtype,
                    fp8: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Slot `slot` of every EP rank (global expert r * e_local + slot), gathered over expert-TP, then over EP; fp8:
    as block-FP8 pairs (`_expert_fp8`)."""
    if fp8:
        return _expert_fp8(p, kind, layer, slot, e_local, etp_group, ep_group)
    dtype = export_dtype(f"{layer}.mlp.experts.{slot}.down_proj.weight", dtype)  # every expert weight alike
    src = _narrowed(p, dtype)
    if kind == "expert_glu":
        halves = [_gather_first(x, etp_group, 0) for x in src.chunk(2, dim=0)]
        local = None if halves[0] is None else torch.cat(halves, dim=0)
        del halves
    else:
        local = _gather_first(src, etp_group, 1)
    stack = None if local is None else _gather_stack(local, ep_group)
    if stack is None:
        return []
    out = []
    for r, t in enumerate(stack.unbind(0)):
        x = f"{layer}.mlp.experts.{r * e_local + slot}."
        if kind == "expert_glu":
            gate, up = t.chunk(2, dim=0)
            out += [(x + "gate_proj.weight", _owned(gate, p, dtype)), (x + "up_proj.weight", _owned(up, p, dtype))]
        else:
            out.append((x + "down_proj.weight", _owned(t, p, dtype)))
    return out


# ---------------------------------------------------------------------------------------------- block-FP8 export
# An FP8 engine's linear weights leave their owners quantized: each shard aligned to the 128 x 128 block along its
# split dimension holds whole blocks of the full tensor, so quantizing it where it lives gives the full tensor's q
# and scales bit for bit (`fp8_block_quantize` per block: amax, one division per element), and the gathers move
# n + 4 ceil(rows/128) ceil(cols/128) bytes for n elements instead of 4 n (float32).


def _fp8_exported(keys: list[str], p: torch.Tensor, fp8: bool) -> bool:
    """Whether an export with `fp8` on sends this parameter's HF tensors as block-FP8 pairs (a linear weight:
    `fp8_quantizable`)."""
    return fp8 and all(fp8_quantizable(k, p) for k in keys)


def _fp8_nbytes(shapes: list[tuple[int, ...]]) -> int:
    """The bytes of the block-FP8 pairs of tensors of these shapes [..., n, m]: one per element (q) and four per
    128 x 128 block (its float32 scale, a partial block counting whole)."""
    total = 0
    for *lead, n, m in shapes:
        total += math.prod(lead) * (n * m + 4 * -(-n // FP8_BLOCK) * -(-m // FP8_BLOCK))
    return total


def _full_shapes(p: torch.Tensor, kind: str, cfg: ModelConfig, world: int) -> list[tuple[int, ...]]:
    """The shapes of the full HF tensors of a parameter shard `p` of `kind` split over `world` ranks (TP; for the
    expert kinds expert-TP, one expert's)."""
    rows, cols = p.shape[0], p.shape[-1]
    if kind == "replicated":
        return [tuple(p.shape)]
    if kind in ("vocab", "col"):
        return [(rows * world, cols)]
    if kind in ("row", "expert"):
        return [(rows, cols * world)]
    if kind == "qkv":
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_query_groups * cfg.head_dim
        return [(q, cols), (kv, cols), (kv, cols)]
    return [(rows // 2 * world, cols)] * 2  # glu, expert_glu: [gate_r; up_r]


def _bytes_of(ts: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of `ts` in one flat uint8 tensor on their device, each padded to a multiple of 4 (every one starts
    4-aligned and views back as float32): one copy. Float8 travels as its bytes (gloo has no float8 type; NCCL's
    byte copy is the same)."""
    parts = []
    for t in ts:
        b = t.contiguous().view(torch.uint8).reshape(-1)
        parts += [b, b.new_zeros(-b.numel() % 4)]
    return torch.cat(parts)


def _tensors_of(row: torch.Tensor, likes: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """The inverse of `_bytes_of`: views into `row` (one rank's bytes) of the shapes and dtypes `likes`."""
    out, at = [], 0
    for shape, dtype in likes:
        n = shape.numel() * dtype.itemsize
        out.append(row[at : at + n].view(dtype).view(shape))
        at += n + -n % 4
    return out


def _fp8_gather_first(shards: list[tuple[torch.Tensor, int]], group) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """[(q, scales)]: `fp8_block_quantize` of each full tensor (the group's shards `shards[i][0]` concatenated along
    `shards[i][1]`) on the group's first rank, None on the others. A shard aligned to the block along its split
    dimension (rows or cols per shard a multiple of 128; any shard of a one-rank group) is quantized where it lives
    and moves as n + 4 x scales bytes; another moves as it is (its dtype's bytes: the parameter's values) and its
    full tensor is quantized on the first rank. One dist.gather of every shard's bytes together (none for a one-rank
    group). Transient on the first rank: the gather buffer and the full tensors, each the item as gathered."""
    world = dist.get_world_size(group)
    aligned = [world == 1 or t.shape[dim] % FP8_BLOCK == 0 for t, dim in shards]
    local = [fp8_block_quantize(t)[::-1] if a else (t,) for (t, dim), a in zip(shards, aligned, strict=True)]
    if world == 1:
        return [(q, s) for s, q in local]
    likes = [[(x.shape, x.dtype) for x in parts] for parts in local]  # (scales, q) or (the shard,)
    buf = _gather_stack(_bytes_of([x for parts in local for x in parts]), group)
    del local
    if buf is None:
        return None
    ranks = [_tensors_of(row, [like for each in likes for like in each]) for row in buf.unbind(0)]
    out, at = [], 0
    for (_, dim), each in zip(shards, likes, strict=True):
        full = [torch.cat([r[at + j] for r in ranks], dim=dim) for j in range(len(each))]
        at += len(each)
        out.append((full[1], full[0]) if len(full) == 2 else fp8_block_quantize(full[0]))
    return out


def _fp8_gather_stack(pairs: list[tuple[torch.Tensor, torch.Tensor]], group) -> list[list[tuple]] | None:
    """Every group rank's block-FP8 `pairs` [(q, scales)] (alike in shapes on every rank), in group-rank order on
    the group's first rank (None on the others): one dist.gather of their bytes (n + 4 x scales each), copied out of
    the gather buffer (which goes at the return: at most twice the pairs of the group while copying)."""
    if dist.get_world_size(group) == 1:
        return [pairs]
    flat = [x for q, s in pairs for x in (s, q)]
    likes = [(x.shape, x.dtype) for x in flat]
    stack = _gather_stack(_bytes_of(flat), group)
    del flat
    if stack is None:
        return None
    out = []
    for row in stack.unbind(0):
        ts = _tensors_of(row, likes)  # scales, q, scales, q, ...
        out.append([(q.clone(), s.clone()) for s, q in zip(ts[0::2], ts[1::2], strict=True)])
    return out


def _fp8_keyed(keys: list[str], pairs) -> list[tuple[str, torch.Tensor]]:
    """[(key, q), (key + "_scale_inv", scales)] for each key, in order (`fp8_block_state`'s layout)."""
    return [kt for k, (q, s) in zip(keys, pairs, strict=True) for kt in ((k, q), (k + FP8_SCALE_SUFFIX, s))]


def _dense_fp8(p, kind: str, keys: list[str], cfg: ModelConfig, g) -> list[tuple[str, torch.Tensor]]:
    """The block-FP8 pairs of a dense linear weight's HF tensors on its TP group's first rank (empty elsewhere),
    quantized on each shard owner where the shard is block-aligned (`_fp8_gather_first`): col / vocab by row blocks,
    row by column blocks, glu's gate and up halves, qkv's de-interleaved q / k / v rows (each a contiguous row block
    of HF q / k / v). A replicated weight is quantized on the first rank alone, with no gather. One dist.gather per
    weight (glu and qkv too); 1 byte per element + scales moved where aligned, the parameter's bytes elsewhere."""
    world = dist.get_world_size(g)
    if kind == "replicated":
        return _fp8_keyed(keys, [fp8_block_quantize(p)]) if dist.get_rank(g) == 0 else []
    if kind == "qkv":
        shards = [(t, 0) for t in _qkv_from_megatron(p, cfg, cfg.num_query_groups // world)]
    elif kind == "glu":
        shards = [(x, 0) for x in p.chunk(2, dim=0)]
    else:
        shards = [(p, 1 if kind == "row" else 0)]
    pairs = _fp8_gather_first(shards, g)
    return [] if pairs is None else _fp8_keyed(keys, pairs)


def _expert_fp8(p, kind: str, layer: str, slot: int, e_local: int, etp_group, ep_group
                ) -> list[tuple[str, torch.Tensor]]:
    """The block-FP8 pairs of slot `slot` of every EP rank (global expert r * e_local + slot): gathered over
    expert-TP as in `_fp8_gather_first` (quantized per shard where aligned, else on the expert-TP first rank), then,
    quantized, over EP: EP moves 1 byte per element + scales. Two dist.gathers (one per group larger than one)."""
    shards = [(x, 0) for x in p.chunk(2, dim=0)] if kind == "expert_glu" else [(p, 1)]
    local = _fp8_gather_first(shards, etp_group)
    stack = None if local is None else _fp8_gather_stack(local, ep_group)
    del local
    if stack is None:
        return []
    names = ("gate_proj.weight", "up_proj.weight") if kind == "expert_glu" else ("down_proj.weight",)
    return [kt for r, pairs in enumerate(stack)
            for kt in _fp8_keyed([f"{layer}.mlp.experts.{r * e_local + slot}.{n}" for n in names], pairs)]


# ---------------------------------------------------------------------------------------------- the stream


def _export_items(model, cfg: ModelConfig, ctx: ParallelContext, fp8: bool = False) -> list[_ExportItem]:
    """This stage's parameters in mapping order (chunk by chunk), each with its full (gathered) size."""
    return [item for chunk, mapping in _chunk_mappings(model, cfg, ctx)
            for item in _chunk_items(chunk, _exported(mapping), cfg, ctx, fp8)]


def _chunk_items(chunk, mapping, cfg: ModelConfig, ctx: ParallelContext, fp8: bool = False) -> list[_ExportItem]:
    """A chunk's export items; fp8: its linear weights as block-FP8 pairs (`_fp8_exported`), sized as such."""
    from functools import partial

    tp, ep, etp, g = ctx.tp, ctx.ep, ctx.etp, ctx.groups
    e_local = cfg.num_experts // ep if cfg.is_moe else 0
    named = {n: p.detach() for n, p in _named_weights(chunk).items()}
    items = []
    for name, keys, kind in mapping:
        if kind in ("expert", "expert_glu"):
            base, e = name.split("#")
            if int(e) >= e_local:
                continue  # one item per local slot: slot j of EP rank r is global expert r * e_local + j
            p = _param(named, base.format(local=int(e)))
            layer = keys[0].split(".mlp.experts.")[0]
            q = _fp8_exported(keys, p, fp8)
            items.append(_ExportItem(p.numel() * etp * ep, True,
                                     partial(_expert_tensors, p, kind, layer, int(e), e_local, g.expt_tp, g.ep,
                                             fp8=q), ep * _fp8_nbytes(_full_shapes(p, kind, cfg, etp)) if q else 0))
        else:
            p = _param(named, name)
            q = _fp8_exported(keys, p, fp8)
            items.append(_ExportItem(p.numel() * (1 if kind == "replicated" else tp), False,
                                     partial(_dense_tensors, p, kind, keys, cfg, g.tp, fp8=q),
                                     _fp8_nbytes(_full_shapes(p, kind, cfg, tp)) if q else 0))
    return items


@torch.no_grad()
def hf_buckets_from_model(model, cfg: ModelConfig, ctx: ParallelContext, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                          dtype=torch.float32, convert=None, fp8: bool = False):
    """This pipeline stage's weights in the HF layout, as buckets (dicts) of at most `bucket_bytes` in `dtype` (a
    larger tensor is a bucket alone), yielded on the stage's sender (`ctx.roles.sender`) only.

    Every rank of the stage must run the generator to its end (it drives the gathers; it yields nothing off the
    sender). Each tensor is gathered over its owners only, onto the sender: dense ones with one dist.gather over TP
    among the data-parallel rank-0 replicas, expert slots over expert-TP then EP among the expert-data-parallel
    rank-0 replicas (the other replicas take no part). Stages do not exchange anything.

    fp8: every linear weight (`precision.fp8_quantizable`) comes as block-FP8 pairs, q (float8_e4m3fn) at its key
    and float32 scales at key + "_scale_inv", bit for bit what `precision.fp8_block_state` gives of the full tensor
    in the parameter's values (whatever `dtype` says of it), quantized on each shard owner before the TP / expert-TP
    gather where the shard is aligned to the 128 block along its split dimension, else on the gather's first rank,
    and before the EP gather always: those gathers move 1 byte per element + 4 per block, a quarter of float32's.

    Memory on the sender, beyond its shards: at most max(bucket_bytes, T) + T, T the largest full tensor as it is
    gathered (n x `dtype`'s bytes; under fp8 a linear weight's n + 4 x blocks, or, unaligned, n x the parameter's)
    (the bucket is yielded before a tensor that would overflow it is gathered, its size counted as it will be in
    the bucket; a tensor's gather buffer and its converted copy together take at most 2 T, of which T stays in the
    bucket). `dtype` may be a function of the HF key (a dtype per tensor); `convert` ({key: tensor} -> {key:
    tensor}, e.g. block-FP8 pairs for an FP8 engine) is applied to each tensor as it is gathered, on the sender.
    Every other rank: one contiguous copy of a shard at most (under fp8 its q and scales, and their bytes; on every
    rank the quantization's float32 temporaries, under 3 x precision.FP8_QUANTIZE_CHUNK_BYTES). A bucket
    is valid until the next one is asked for: the generator clears it then (so that a consumer's loop variable
    never keeps two alive); copy what must outlive it. Traffic: each parameter's bytes once over its gather group;
    no host sync beyond the gathers (one per tensor, two per GLU weight; under fp8 one per linear weight, GLU and
    q / k / v too, and per expert slot one over expert-TP and one over EP)."""
    roles = ctx.roles
    width = 4 if callable(dtype) else torch.empty((), dtype=dtype).element_size()  # per key: at most float32
    bucket, size = {}, 0
    for item in _export_items(model, cfg, ctx, fp8):
        if not (roles.expert if item.expert else roles.dense):
            continue
        nbytes = item.fp8_bytes or item.numel * width
        if roles.sender and bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket.clear()  # the consumer's reference too: the tensors go now
            size = 0
        for key, t in item.fetch(dtype):
            if roles.sender:  # converted as it comes: the bucket never holds the unconverted tensors
                for k, v in (convert({key: t}) if convert else {key: t}).items():
                    bucket[k] = v
                    size += v.numel() * v.element_size()
                del t
    if bucket:
        yield bucket
        bucket.clear()


# ---------------------------------------------------------------------------------------------- files


HF_INDEX = "model.safetensors.index.json"


def save_hf_checkpoint(directory, state, cfg: ModelConfig, *, extra_config=None, fp8_blocks: bool = False,
                       tokenizer_dir=None) -> Path:
    """Write an HF checkpoint atomically enough for a reader polling the directory: every file under a temporary
    name, renamed, config.json last. state: a full state dict (one model.safetensors), or an iterable of buckets
    (`hf_buckets_from_model`, a weight sync's stream), written one shard each (model-00001.safetensors, ...) with
    model.safetensors.index.json, holding one bucket at a time (and its FP8 copy). Weight files of an earlier
    checkpoint in the directory are removed. fp8_blocks: a block-FP8 checkpoint (each linear weight quantized to
    float8_e4m3fn with 128 x 128 block scales, `quantization_config` in config.json). tokenizer_dir: copy its
    tokenizer files beside the weights (an engine loads the checkpoint's tokenizer)."""
    if isinstance(state, Mapping):
        Path(directory).mkdir(parents=True, exist_ok=True)
        keys, _ = _save_shard(Path(directory) / "model.safetensors", state, fp8_blocks)
        weight_map, total = dict.fromkeys(keys, "model.safetensors"), None
    else:
        weight_map, total, _ = save_hf_shards(directory, state, fp8_blocks=fp8_blocks)
    return finish_hf_checkpoint(directory, weight_map, total, cfg, extra_config=extra_config, fp8_blocks=fp8_blocks,
                                tokenizer_dir=tokenizer_dir)


def save_hf_shards(directory, buckets, *, prefix: str = "model", fp8_blocks: bool = False
                   ) -> tuple[dict[str, str], int, dict[str, int]]:
    """One safetensors shard per bucket under `directory` (<prefix>-00001.safetensors, ...), each written under a
    temporary name and renamed, holding one bucket at a time (and its FP8 copy); no index, no config: a checkpoint
    is complete once `finish_hf_checkpoint` ran. Several writers (a weight sync's pipeline stages, each with its own
    prefix) may fill one directory. Returns (HF key -> file name, tensor bytes written, file name -> its size as
    this writer sees it)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map, total, sizes = {}, 0, {}
    for i, bucket in enumerate(buckets):
        name = f"{prefix}-{i + 1:05d}.safetensors"
        keys, nbytes = _save_shard(directory / name, bucket, fp8_blocks)
        weight_map.update(dict.fromkeys(keys, name))
        total += nbytes
        sizes[name] = (directory / name).stat().st_size
        del bucket  # the stream's next bucket is made while none of this one is held here
    return weight_map, total, sizes


def finish_hf_checkpoint(directory, weight_map: dict[str, str], total: int | None, cfg: ModelConfig, *,
                         extra_config=None, fp8_blocks: bool = False, tokenizer_dir=None) -> Path:
    """Complete the checkpoint whose shards (`save_hf_shards`, any number of writers) hold `weight_map` (HF key ->
    file; `total` bytes; None: one model.safetensors, no index): weight files outside the map are removed (an
    earlier checkpoint's, a writer's that was cut short), then the index, the tokenizer files and config.json, in
    that order, each renamed into place (config.json last: a reader that sees it sees a whole checkpoint)."""
    from megatron_pdm.precision import FP8_QUANTIZATION_CONFIG

    from .tokenizer import copy_tokenizer_files

    if fp8_blocks:
        extra_config = {**(extra_config or {}), "quantization_config": FP8_QUANTIZATION_CONFIG}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = set(weight_map.values())
    for f in directory.glob("*.safetensors"):
        if f.name not in files:
            f.unlink()
    index = directory / HF_INDEX
    if total is None:
        index.unlink(missing_ok=True)
    else:
        _write_atomic(index, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, directory)
    _write_atomic(directory / "config.json", hf_config_dict(cfg) | (extra_config or {}))
    return directory


def _save_shard(path: Path, bucket: Mapping[str, torch.Tensor], fp8_blocks: bool) -> tuple[list[str], int]:
    """One safetensors file (block-FP8 when asked), written under a temporary name and renamed; its keys, bytes."""
    from safetensors.torch import save_file

    from megatron_pdm.precision import fp8_block_state

    tensors = fp8_block_state(bucket) if fp8_blocks else bucket
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
    return list(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def _write_atomic(path: Path, payload: dict) -> None:
    write_atomic(path, json.dumps(payload, indent=2) + "\n")


# safetensors' names of the float8 dtypes: a tensor in one is raw codes until its block scales multiply it
FLOAT8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})


def _header_dtypes(path: Path) -> dict[str, str]:
    """key -> safetensors dtype name of every tensor in one file, from its header alone (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), "pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    return {k: handle.get_slice(k).get_dtype() for k in handle.keys()}  # noqa: SIM118 (a handle, not a dict)


def _index_weight_map(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's weight_map (HF key -> file name); ValueError naming the index for a file that
    is not one, or a tensor it names in two files (which one holds it is then unknown)."""
    def pairs(items):
        out = {}
        for k, v in items:
            if k in out and out[k] != v:
                raise ValueError(f"{index}: names {k} twice, in {out[k]} and {v}")
            out[k] = v
        return out

    try:
        weight_map = json.loads(index.read_text(), object_pairs_hook=pairs).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index ({e})") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(f, str) and f.endswith(".safetensors") and "/" not in f for f in weight_map.values()):
        raise ValueError(f"{index}: weight_map: expected {{tensor: file name}} of *.safetensors files beside it, "
                         f"got {str(weight_map)[:200]}")
    return weight_map


def _check_fp8_pairs(files: Mapping[str, Path], dtypes: Mapping[str, str]) -> None:
    """ValueError naming the tensor and its file for a float8 weight without its `_scale_inv` (it would load as raw
    e4m3 codes, thousands of times too large), and for scales without a float8 weight to multiply."""
    for key, dtype in dtypes.items():
        weight = key.removesuffix(FP8_SCALE_SUFFIX)
        if key == weight and dtype in FLOAT8_DTYPES and key + FP8_SCALE_SUFFIX not in dtypes:
            raise ValueError(f"{key} ({files[key]}): a {dtype} weight without its block-FP8 scales "
                             f"{key}{FP8_SCALE_SUFFIX} in the checkpoint")
        if key != weight and weight not in dtypes:
            raise ValueError(f"{key} ({files[key]}): block-FP8 scales without their weight")
        if key != weight and dtypes[weight] not in FLOAT8_DTYPES:
            raise ValueError(f"{key} ({files[key]}): block-FP8 scales beside {weight} ({files[weight]}), which is "
                             f"{dtypes[weight]}, not float8")


def checkpoint_files(directory) -> dict[str, Path]:
    """HF key -> the file that holds it, for the HF checkpoint in `directory`: the one reader of which files a
    checkpoint's tensors come from (`load_hf_checkpoint`, `rollout.fp8_export`). With model.safetensors.index.json,
    exactly the tensors its weight_map names, each from the file it names; a *.safetensors file beside it that it
    does not name, and a tensor that a named file holds beside its own, are not read (a leftover file never
    overrides a tensor) and are logged. Without an index, every *.safetensors file's tensors, a tensor held by two
    files refused (which one is meant is unknown).

    Refused before any tensor is read (headers only, a few bytes a tensor), naming the tensor and the file: a file
    the index names that is missing or lacks the tensor (FileNotFoundError / ValueError), a float8 weight without its
    block-FP8 scales or scales without a float8 weight (`_check_fp8_pairs`)."""
    directory = Path(directory)
    on_disk = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    index = directory / HF_INDEX
    if not index.is_file():
        if not on_disk:
            raise FileNotFoundError(f"{directory}: no *.safetensors files")
        files, dtypes = {}, {}
        for path in on_disk:
            for key, dtype in _header_dtypes(path).items():
                if key in files:
                    raise ValueError(f"{key}: held by both {files[key]} and {path}, and no {HF_INDEX} says which "
                                     "is the checkpoint's")
                files[key], dtypes[key] = path, dtype
        _check_fp8_pairs(files, dtypes)
        return files
    weight_map = _index_weight_map(index)
    headers = {}
    for key, name in weight_map.items():
        if name not in headers:
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory / name}: missing, though {HF_INDEX} names it for {key}")
            headers[name] = _header_dtypes(directory / name)
        if key not in headers[name]:
            raise ValueError(f"{key}: {HF_INDEX} names {directory / name} for it, which does not hold it")
    unread = [p.name for p in on_disk if p.name not in headers]
    unread += [f"{k} in {name}" for name, dtypes in headers.items() for k in dtypes if weight_map.get(k) != name]
    if unread:
        log.warning("%s: %s does not name these, which are not read: %s%s", directory, HF_INDEX,
                    ", ".join(unread[:4]), f" and {len(unread) - 4} more" if len(unread) > 4 else "")
    files = {k: directory / name for k, name in weight_map.items()}
    _check_fp8_pairs(files, {k: headers[name][k] for k, name in weight_map.items()})
    return files


class HFCheckpointState(Mapping):
    """The tensors of an HF checkpoint (`checkpoint_files`: key -> its file), each read when it is asked for
    (memory-mapped, one tensor at a time), a block-FP8 weight (float8_e4m3fn q with its `_scale_inv` block scales, as
    DeepSeek-V3 and Kimi-K2 are released) dequantized to float32 as it is read. A rank that loads its shards reads
    the full tensors of its own layers only: never the whole model in memory (a 671B checkpoint is 1.3 TB in
    float32)."""

    def __init__(self, files: Mapping[str, Path]):
        from safetensors import safe_open

        # key -> the open (memory-mapped) file holding it, each file opened once; the scales may sit in another
        # shard than their weight
        handles = {path: safe_open(str(path), "pt") for path in set(files.values())}
        self._file, self._scales = {}, {}
        for key, path in files.items():
            (self._scales if key.endswith(FP8_SCALE_SUFFIX) else self._file)[key] = handles[path]

    def __getitem__(self, key: str) -> torch.Tensor:
        from megatron_pdm.precision import fp8_block_dequantize

        t = self._file[key].get_tensor(key)
        scale = key + FP8_SCALE_SUFFIX
        if scale in self._scales:
            return fp8_block_dequantize(t, self._scales[scale].get_tensor(scale), torch.float32)
        return t

    def __contains__(self, key) -> bool:  # Mapping's default would read the tensor
        return key in self._file

    def __iter__(self):
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)


def is_mtp_key(key: str, cfg: ModelConfig) -> bool:
    """Whether an HF key is a multi-token-prediction layer's (`model.layers.{i}.*` for i >= num_layers; DeepSeek-V3's
    `model.layers.61.*`): a layer beside the main model, which neither RL nor an engine's main model uses (SGLang's
    DeepseekV3ForCausalLM skips it too)."""
    layer = key.removeprefix("model.layers.").split(".", 1)[0]
    return key.startswith("model.layers.") and layer.isdigit() and int(layer) >= cfg.num_layers


def mtp_keys(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> list[str]:
    """The multi-token-prediction layers' keys of a DeepSeek-V3 checkpoint (`is_mtp_key`), which RL does not train:
    carried unchanged into exports, so that an engine serving the export can still decode speculatively with
    them."""
    return [k for k in state if is_mtp_key(k, cfg)]


def load_hf_checkpoint(directory) -> tuple[HFCheckpointState, ModelConfig]:
    """(state, config) of an HF checkpoint directory; the state reads each tensor when asked for it
    (`HFCheckpointState`) from the file `checkpoint_files` says holds it, a block-FP8 one dequantized to float32."""
    directory = Path(directory)
    config = directory / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config}: no config.json in the HF checkpoint directory")
    files = checkpoint_files(directory)
    cfg = model_config_from_hf(json.loads(config.read_text()))
    return HFCheckpointState(files), cfg


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
