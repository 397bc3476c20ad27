"""Block-FP8 weights quantized on each shard owner before the TP / expert-TP / EP gathers (models/hf/export.py
`hf_buckets_from_model(..., fp8=True)`): the stream is bit for bit what gathering the linear weights in float32 and
quantizing them on the sender (`precision.fp8_block_state`, an FP8 engine's `convert`) gives, at TP 1, 2, 4, under
EP and expert-TP, and where a shard is not block-aligned (quantized on the sender then); the gathers of the
quantized weights move a quarter of the bytes (1 per element + 4 per 128 x 128 block, against 4 per element)."""

import os
import re
from functools import partial

import pytest
import torch

from megatron_pdm.models import ModelConfig, ParallelConfig, canonical_hf_state
from megatron_pdm.precision import FP8_BLOCK, FP8_SCALE_SUFFIX, fp8_block_quantize, fp8_quantizable
from tests.helpers import _setup, hf_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# every shard block-aligned at TP 1, 2 and 4: q / k / v rows per shard 256 / 128 / 128 at TP 4, o_proj's 1024
# columns, gate / up's 512 rows and down's 512 columns split in 128s
ALIGNED = ModelConfig(vocab_size=512, hidden_size=256, num_layers=2, num_attention_heads=8, num_query_groups=4,
                      head_dim=128, ffn_hidden_size=512, max_position_embeddings=64)
# at TP 2: q rows per shard 256 (aligned), k / v 64 and gate / up / down 192 (not): quantized on the sender
UNALIGNED = ModelConfig(vocab_size=512, hidden_size=256, num_layers=2, num_attention_heads=8, num_query_groups=2,
                        head_dim=64, ffn_hidden_size=384, max_position_embeddings=64)
# experts of 128 rows (gate / up) and columns (down): whole under EP, 64-wide (unaligned) shards under expert-TP 2
MOE = ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=256, num_layers=2, num_attention_heads=4,
                  num_query_groups=2, head_dim=128, ffn_hidden_size=512, num_experts=4, moe_ffn_hidden_size=128,
                  moe_router_topk=2, moe_aux_loss_coeff=0.0, max_position_embeddings=64)
BUCKET_BYTES = 1 << 20  # several buckets per stream


def _engine_dtype(key):
    """An FP8 engine's gather dtypes (train/weight_sync.py): float32 for the weights it quantizes, bf16 the rest."""
    from megatron_pdm.precision import fp8_quantizable_name

    return torch.float32 if fp8_quantizable_name(key) else torch.bfloat16


def _counting_gathers(moved):
    """dist.gather wrapped: the bytes each call receives (every shard but the receiver's own), by dtype name."""
    import torch.distributed as dist

    real = dist.gather

    def gather(t, gather_list=None, *args, **kwargs):
        got = sum(x.numel() * x.element_size() for x in (gather_list or [])[1:])
        moved[str(t.dtype)] = moved.get(str(t.dtype), 0) + got
        return real(t, gather_list, *args, **kwargs)

    return real, gather


def rank_fp8_streams(group, cfg, parallel, state):
    """{run: (buckets as [(key, tensor)] lists, copied; {dtype: bytes this rank received by dist.gather})} for
    the FP8-engine export before quantizing on the owners (False: float32 gathers, `engine_state` converting on
    the sender), fp8=True (True:
    quantized on the shard owners, the same `convert` after it, passing the pairs through) and fp8=True with the
    engine's dtype alone ("plain": bf16 for the rest, no `convert`)."""
    import torch.distributed as dist

    from megatron_pdm.models.hf import hf_buckets_from_model
    from megatron_pdm.rollout.sglang.transports import engine_state

    model, ctx = _setup(cfg, parallel, state)
    convert = partial(engine_state, fp8=True, dtype="bfloat16")
    out = {}
    runs = {False: dict(dtype=_engine_dtype, convert=convert), True: dict(dtype=_engine_dtype, convert=convert,
            fp8=True), "plain": dict(dtype=torch.bfloat16, fp8=True)}
    for run, kwargs in runs.items():
        moved = {}
        real, dist.gather = _counting_gathers(moved)
        try:
            buckets = [[(k, t.clone()) for k, t in b.items()]
                       for b in hf_buckets_from_model(model, cfg, ctx, bucket_bytes=BUCKET_BYTES, **kwargs)]
        finally:
            dist.gather = real
        out[run] = buckets, moved
    ctx.close()
    return out


def _split_dim(key: str) -> int:
    """The dimension megatron splits an HF linear weight over (expert-)TP: columns of o_proj / down_proj, else rows."""
    return 1 if key.endswith(("o_proj.weight", "down_proj.weight")) else 0


def _expected_gathered(state, parallel: ParallelConfig) -> tuple[int, int]:
    """(bytes the quantized weights' gathers move with fp8=True, the same weights' bytes gathered in float32, as
    before), summed
    over the ranks: per weight of n elements and s block scales, over a group of W ranks, (W - 1) / W of n + 4 s
    where the shards are aligned (q bytes + scales), of 4 n where not (the parameters, float32), and, for an expert,
    over expert-TP (W = etp) then EP, which always moves it quantized."""
    from megatron_pdm.models.parallel import expert_tensor_parallel_size

    tp, ep, etp = parallel.tensor, parallel.expert, expert_tensor_parallel_size(parallel)
    fp8, f32 = 0.0, 0.0
    for k, w in state.items():
        if not fp8_quantizable(k, w):
            continue
        n, s = w.numel(), fp8_block_quantize(w)[1].numel()
        world = etp if ".experts." in k else tp
        aligned = world == 1 or (w.shape[_split_dim(k)] // world) % FP8_BLOCK == 0
        fp8 += (n + 4 * s if aligned else 4 * n) * (world - 1) / world
        f32 += 4 * n * (world - 1) / world
        if ".experts." in k:
            fp8 += (n + 4 * s) * (ep - 1) / ep
            f32 += 4 * n * (ep - 1) / ep
    return round(fp8), round(f32)


def _item(key: str) -> str:
    """The export item an HF key comes from: a weight with its scales, q / k / v of one layer together, gate / up
    together, an expert layer's experts together."""
    key = re.sub(r"experts\.\d+\.", "experts.*.", key.removesuffix(FP8_SCALE_SUFFIX))
    return re.sub(r"(q|k|v)_proj", "qkv", re.sub(r"(gate|up)_proj", "fc1", key))


def _total(results, fp8: bool, dtype: str) -> int:
    return sum(r[fp8][1].get(dtype, 0) for r in results)


CASES = [(ALIGNED, dict(tensor=1), 1), (ALIGNED, dict(tensor=2), 2), (ALIGNED, dict(tensor=4), 4),
         (UNALIGNED, dict(tensor=2), 2), (MOE, dict(expert=2), 2), (MOE, dict(tensor=2, expert=2, expert_tensor=2), 4)]


@pytest.mark.parametrize("cfg,parallel,world", CASES,
                         ids=["tp1", "tp2", "tp4", "unaligned-tp2", "moe-ep2", "moe-etp2-ep2"])
def test_fp8_on_the_shard_owners_is_the_sender_quantized_stream(dist_pools, cfg, parallel, world):
    """Same keys in the same order, dtypes, shapes and bits (q compared as bytes) as quantizing on the sender, also
    with no `convert` and bf16 for the rest; each bucket within bucket_bytes (unless one item), counted at its
    block-FP8 size, so never more buckets than the float32-gather path;
    the quantized weights' gathers move exactly n + 4 s bytes (or 4 n where a shard is unaligned) in uint8 and no
    float32 is gathered, the other weights' bf16 bytes unchanged."""
    state = canonical_hf_state(hf_model(cfg, seed=11).state_dict())
    par = ParallelConfig(**parallel)
    results = dist_pools(world).run(rank_fp8_streams, shared=(cfg, par, state))
    (old, _), (new, _) = results[0][False], results[0][True]
    assert all(not r[run][0] for r in results[1:] for run in r), "only the sender yields buckets"
    old_flat = [kt for b in old for kt in b]
    for run in (True, "plain"):  # the pairs need no `convert`, nor float32 gathers of the rest
        new_flat = [kt for b in results[0][run][0] for kt in b]
        assert [k for k, _ in new_flat] == [k for k, _ in old_flat]
        quantized = 0
        for (k, a), (_, b) in zip(old_flat, new_flat, strict=True):
            assert (a.dtype, a.shape) == (b.dtype, b.shape), k
            if a.dtype == torch.float8_e4m3fn:
                quantized += 1
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert torch.equal(a, b), k
        assert quantized == sum(fp8_quantizable(k, w) for k, w in state.items()) > 0
    assert {k.removesuffix(FP8_SCALE_SUFFIX) for k, _ in new_flat} == set(state)
    for b in new:
        nbytes = sum(t.numel() * t.element_size() for _, t in b)
        assert nbytes <= BUCKET_BYTES or len({_item(k) for k, _ in b}) == 1, (nbytes, [k for k, _ in b])
    assert len(new) <= len(old)
    fp8_bytes, f32_bytes = _expected_gathered(state, par)
    assert _total(results, True, "torch.uint8") == fp8_bytes
    assert _total(results, False, "torch.float32") == f32_bytes
    assert _total(results, True, "torch.float32") == 0
    assert _total(results, True, "torch.bfloat16") == _total(results, False, "torch.bfloat16")
    if world > 1 and cfg is ALIGNED:  # a quarter, plus 4 bytes per 128 x 128 block
        assert 0.25 < fp8_bytes / f32_bytes < 0.2501, (fp8_bytes, f32_bytes)
    elif world > 1:
        assert fp8_bytes < f32_bytes


def test_an_aligned_shard_holds_whole_blocks_of_the_full_tensor():
    """The invariant the owners' quantization rests on: shards of 128-multiple rows (cols) quantize to row (col)
    blocks of the full tensor's q and scales, a partial block on the other dimension included; the local q / k / v
    rows of a megatron qkv shard are contiguous row blocks of HF q / k / v; `_fp8_nbytes` is the pairs' size."""
    from megatron_pdm.models.hf.export import _fp8_nbytes
    from megatron_pdm.models.hf.mapping import _qkv_from_megatron, _qkv_to_megatron

    g = torch.Generator().manual_seed(3)
    w = torch.randn(512, 200, generator=g) * torch.logspace(-3, 2, 200)  # 200 = a block and a partial one
    q, s = fp8_block_quantize(w)
    for dim in (0, 1):  # 4 shards of 128 rows of [512, 200], of 128 columns of [200, 512]
        x = w if dim == 0 else w.T.contiguous()
        full_q, full_s = fp8_block_quantize(x)
        parts = [fp8_block_quantize(c) for c in x.chunk(4, dim=dim)]
        assert torch.equal(torch.cat([p[0] for p in parts], dim).view(torch.uint8), full_q.view(torch.uint8))
        assert torch.equal(torch.cat([p[1] for p in parts], dim), full_s)
    assert _fp8_nbytes([tuple(w.shape)]) == q.numel() + 4 * s.numel()
    cfg, tp = ALIGNED, 2
    hd, H = cfg.head_dim, cfg.hidden_size
    hq, hk, hv = (torch.randn(n * hd, H, generator=g)
                  for n in (cfg.num_attention_heads, cfg.num_query_groups, cfg.num_query_groups))
    shards = _qkv_to_megatron(hq, hk, hv, cfg).chunk(tp, dim=0)
    for rank, shard in enumerate(shards):
        for got, full in zip(_qkv_from_megatron(shard, cfg, cfg.num_query_groups // tp), (hq, hk, hv), strict=True):
            assert torch.equal(got, full.chunk(tp, dim=0)[rank])
