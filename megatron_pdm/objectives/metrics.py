"""Diagnostics as sums and counts, accumulated over micro-batches and reduced once over data-parallel ranks.

Per-token statistics from `megatron_pdm.vocab_parallel` are already identical on every tensor-parallel rank, so
`reduce` takes the data-parallel group (all ranks holding different tokens), never the TP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Metrics:
    """Named means (sum / count) and maxima; `reduce` returns plain floats, NaN for an empty mean."""

    def __init__(self):
        self.sums: dict[str, float | torch.Tensor] = {}
        self.counts: dict[str, float | torch.Tensor] = {}
        self.maxes: dict[str, float | torch.Tensor] = {}

    def add_mean(self, name: str, values: torch.Tensor, where: torch.Tensor | None = None) -> None:
        values = values.detach().double()
        w = torch.ones_like(values) if where is None else where.detach().double()
        self.sums[name] = self.sums.get(name, 0.0) + (values * w).sum()
        self.counts[name] = self.counts.get(name, 0.0) + w.sum()

    def add_fraction(self, name: str, event: torch.Tensor, where: torch.Tensor) -> None:
        self.add_mean(name, event.double(), where)

    def add_max(self, name: str, values: torch.Tensor, where: torch.Tensor | None = None) -> None:
        values = values.detach().double()
        if where is not None:
            values = torch.where(where.bool(), values, float("-inf"))
        m = values.max() if values.numel() else torch.tensor(float("-inf"), dtype=torch.float64)
        self.maxes[name] = torch.maximum(torch.as_tensor(self.maxes.get(name, float("-inf")), dtype=torch.float64), m)

    def merge(self, other: Metrics) -> Metrics:
        for name in other.sums:
            self.sums[name] = self.sums.get(name, 0.0) + other.sums[name]
            self.counts[name] = self.counts.get(name, 0.0) + other.counts[name]
        for name, m in other.maxes.items():
            self.add_max(name, torch.as_tensor(m, dtype=torch.float64).reshape(1))
        return self

    def reduce(self, group=None) -> dict[str, float]:
        """Means and maxima over every rank of `group` (None: this process only), one collective each."""
        names, maxes = sorted(self.sums), sorted(self.maxes)
        packed = torch.tensor([[float(self.sums[n]), float(self.counts[n])] for n in names], dtype=torch.float64)
        mx = torch.tensor([float(self.maxes[n]) for n in maxes], dtype=torch.float64)
        if group is not None and dist.get_world_size(group) > 1:
            if names:
                dist.all_reduce(packed, group=group)
            if maxes:
                dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
        out = {n: (s / c if c > 0 else float("nan")) for n, (s, c) in zip(names, packed.tolist(), strict=True)}
        out.update({n: (v if v != float("-inf") else float("nan")) for n, v in zip(maxes, mx.tolist(), strict=True)})
        return out
