"""The HF <-> megatron tensor map (rows from the families' tensor lists, `models.families`) and the whole-state
import / export through it; the module docstring of `models.hf` gives the layout facts it relies on."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..families import layer_tensors, model_tensors
from ..gpt import model_chunks
from ..parallel import ParallelContext

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
