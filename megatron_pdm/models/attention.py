"""Causal self-attention over a sequence split across the context-parallel (CP) group, for the local layer spec.

megatron-core runs context parallelism only through Transformer Engine (its local `DotProductAttention` asserts
CP = 1). With CP = c each rank holds 2 of the sequence's 2c equal chunks, megatron's load-balanced layout: rank r
holds chunks r and 2c-1-r (`get_pos_emb_on_this_cp_rank` slices RoPE that way; `Batch.context_shard` slices the
tokens). This module computes the same function as TE's context-parallel attention with the all-gather
communication (`cp_comm_type="all_gather"`): keys and values are gathered over the CP group (backward: their
gradients reduce-scattered), put back in sequence order, and each local query attends to the keys at or before its
global position:

    out_i = softmax_j( q_i . k_j / sqrt(d) + (0 if pos_j <= pos_i else -inf) ) v_j,   j over the whole sequence.

Cost per layer: one all-gather of K and of V ([S, B, groups/tp, d] each) and S/c x S scores per head, against
TE's ring (P2P) exchange which overlaps the same traffic with compute. On a GPU the TE spec is used instead.
"""

from __future__ import annotations

import math

import torch


def zigzag_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two of 2 x size sequence chunks held by context-parallel rank `rank` (megatron's layout)."""
    return rank, 2 * size - 1 - rank


def zigzag_positions(seq_len: int, rank: int, size: int, device=None) -> torch.Tensor:
    """[seq_len / size] the global positions of the tokens held by `rank`, in local order."""
    chunk = seq_len // (2 * size)
    a, b = zigzag_chunks(rank, size)
    base = torch.arange(chunk, device=device)
    return torch.cat([a * chunk + base, b * chunk + base])


def _gathered_order(local_len: int, size: int, device) -> torch.Tensor:
    """Index into the rank-major all-gather of every rank's local tokens ([size x local_len]) that puts them in
    sequence order: global chunk c sits in rank c's first half (c < size) or rank 2 size-1-c's second half."""
    chunk = local_len // 2
    base = torch.arange(chunk, device=device)
    starts = [c * local_len if c < size else (2 * size - 1 - c) * local_len + chunk for c in range(2 * size)]
    return torch.cat([s + base for s in starts])


class ContextParallelAttention(torch.nn.Module):
    """megatron's core-attention interface (`DotProductAttention`'s constructor and forward) for CP > 1 on the
    local spec. query [sq, b, np, hn], key / value [sq, b, ng, hn] (sq = this rank's S / CP tokens) -> [sq, b,
    np x hv]; hv = hn except under multi-latent attention (value heads of v_head_dim, its k_channels / v_channels
    arguments). Softmax in fp32; no dropout (the trainer's attention_dropout is 0)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, attention_dropout=None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None, pg_collection=None,
                 k_channels: int | None = None, v_channels: int | None = None):
        super().__init__()
        self.config = config
        if (config.attention_dropout if attention_dropout is None else attention_dropout) != 0:
            raise ValueError("ContextParallelAttention: attention dropout is not supported")
        if pg_collection is None:  # megatron's Attention always passes its own (the model's)
            raise ValueError("ContextParallelAttention: pg_collection (the model's process groups) is required")
        self.cp_group = pg_collection.cp
        tp = pg_collection.tp.size()
        self.heads, self.groups = config.num_attention_heads // tp, config.num_query_groups // tp
        # multi-latent attention passes its q / k head dim (k_channels) and its softmax scale
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels or config.kv_channels)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("ContextParallelAttention: packed sequences and attention bias need Transformer Engine")
        sq, b = query.shape[:2]
        size, rank = self.cp_group.size(), self.cp_group.rank()
        device = query.device
        # [c x sq, b, ng, hn] rank-major -> sequence order; backward reduce-scatters the gradients back
        order = _gathered_order(sq, size, device)
        key = gather_from_sequence_parallel_region(key, True, group=self.cp_group).index_select(0, order)
        value = gather_from_sequence_parallel_region(value, True, group=self.cp_group).index_select(0, order)
        if self.heads > self.groups:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        q_pos = zigzag_positions(sq * size, rank, size, device)
        future = torch.arange(sq * size, device=device)[None, :] > q_pos[:, None]  # [sq, S] True: masked
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, hn]
        scores = torch.matmul(q * self.scale, k.transpose(-1, -2)).float()  # scaled first: no fp16 overflow
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1).to(v.dtype)
        context = torch.matmul(probs, v)  # [b, np, sq, hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.heads * value.shape[-1])  # MLA: v dim < q dim
