"""Exporting a model as HF tensors in bounded memory (`hf_buckets_from_model`, plain or block-FP8, gathered over
TP / EP / expert TP) and writing HF checkpoints (`save_hf_checkpoint`, `save_hf_shards`, `finish_hf_checkpoint`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_pdm._jsonl import write_atomic
from megatron_pdm.precision import (
    FP8_BLOCK,
    FP8_SCALE_SUFFIX,
    fp8_block_quantize,
    fp8_quantizable,
)

from ..config import ModelConfig
from ..parallel import ParallelContext
from .config import hf_config_dict
from .io import HF_INDEX
from .mapping import (
    _chunk_mappings,
    _exported,
    _named_weights,
    _param,
    _qkv_from_megatron,
    export_dtype,
)

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

    from ..tokenizer import copy_tokenizer_files

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


