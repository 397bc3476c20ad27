"""Diagnostics as sums and counts, accumulated over micro-batches and reduced once over data-parallel ranks.

Per-token statistics from `megatron_pdm.vocab_parallel` are already identical on every tensor-parallel rank, so
`reduce` takes the data-parallel group (all ranks holding different tokens), never the TP group.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

# Quantiles of non-negative values come from a histogram with log-spaced bins, so reducing them over any number of
# ranks is one fixed-size all-reduce: bin 0 holds [0, LO), the last [HI, inf), each other bin spans a factor of
# (HI / LO) ** (1 / (BINS - 2)) ~ 1.037, the relative resolution of a quantile in [LO, HI).
QUANTILE_LO, QUANTILE_HI, QUANTILE_BINS = 1e-6, 1e2, 512


def _histogram_edges() -> torch.Tensor:
    return torch.logspace(math.log10(QUANTILE_LO), math.log10(QUANTILE_HI), QUANTILE_BINS - 1, dtype=torch.float64)


def histogram_quantile(hist: torch.Tensor, q: float) -> float:
    """The q-quantile of the values counted in `hist`: the geometric midpoint of the bin holding it (the bin's
    edge for the two open-ended bins); NaN for an empty histogram."""
    total = float(hist.sum())
    if total <= 0:
        return float("nan")
    b = int(torch.searchsorted(hist.cumsum(0), torch.tensor(q * total, dtype=torch.float64)).clamp(max=len(hist) - 1))
    edges = _histogram_edges()
    if b == 0:
        return 0.0
    if b == len(hist) - 1:
        return float(edges[-1])
    return float((edges[b - 1] * edges[b]).sqrt())


class Metrics:
    """Named means (sum / count), maxima and quantiles; `reduce` returns plain floats, NaN for an empty mean."""

    def __init__(self):
        self.sums: dict[str, float | torch.Tensor] = {}
        self.counts: dict[str, float | torch.Tensor] = {}
        self.maxes: dict[str, float | torch.Tensor] = {}
        self.hists: dict[str, torch.Tensor] = {}  # name "<base>_p<100 q>" -> counts per bin

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

    def add_quantile(self, name: str, values: torch.Tensor, where: torch.Tensor | None = None, *, q: float) -> None:
        """Log the q-quantile of non-negative `values` as `<name>_p<100 q>` (e.g. abs_log_ratio_p99)."""
        values = values.detach().double()
        if where is not None:
            values = values[where.bool()]
        if (values < 0).any():
            raise ValueError(f"{name}: quantiles are of non-negative values, got min {float(values.min())}")
        hist = torch.bincount(torch.bucketize(values, _histogram_edges(), right=True), minlength=QUANTILE_BINS)
        key = f"{name}_p{100 * q:g}"
        self.hists[key] = self.hists.get(key, 0) + hist.double()

    def renamed(self, prefix: str, new_prefix: str) -> Metrics:
        """The entries whose name starts with `prefix`, under `new_prefix` instead."""
        out = Metrics()
        for src, dst in ((self.sums, out.sums), (self.counts, out.counts), (self.maxes, out.maxes),
                         (self.hists, out.hists)):
            dst.update({new_prefix + k[len(prefix):]: v for k, v in src.items() if k.startswith(prefix)})
        return out

    def merge(self, other: Metrics) -> Metrics:
        for name in other.sums:
            self.sums[name] = self.sums.get(name, 0.0) + other.sums[name]
            self.counts[name] = self.counts.get(name, 0.0) + other.counts[name]
        for name, m in other.maxes.items():
            self.add_max(name, torch.as_tensor(m, dtype=torch.float64).reshape(1))
        for key, hist in other.hists.items():
            self.hists[key] = self.hists.get(key, 0) + hist
        return self

    def reduce(self, group=None) -> dict[str, float]:
        """Means, maxima and quantiles over every rank of `group` (None: this process only), one collective each."""
        names, maxes, quantiles = sorted(self.sums), sorted(self.maxes), sorted(self.hists)
        packed = torch.tensor([[float(self.sums[n]), float(self.counts[n])] for n in names], dtype=torch.float64)
        mx = torch.tensor([float(self.maxes[n]) for n in maxes], dtype=torch.float64)
        hists = torch.stack([self.hists[k] for k in quantiles]) if quantiles else None
        if group is not None and dist.get_world_size(group) > 1:
            if names:
                dist.all_reduce(packed, group=group)
            if maxes:
                dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
            if quantiles:
                dist.all_reduce(hists, group=group)
        out = {n: (s / c if c > 0 else float("nan")) for n, (s, c) in zip(names, packed.tolist(), strict=True)}
        out.update({n: (v if v != float("-inf") else float("nan")) for n, v in zip(maxes, mx.tolist(), strict=True)})
        for i, key in enumerate(quantiles):
            out[key] = histogram_quantile(hists[i], float(key.rsplit("_p", 1)[1]) / 100)
        return out
