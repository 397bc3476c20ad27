"""Diagnostics as sums and counts, accumulated over micro-batches and reduced once over data-parallel ranks.

Per-token statistics from `megatron_pdm.vocab_parallel` are already identical on every tensor-parallel rank, so
`reduce` takes the group of all ranks holding different tokens (data parallel, with context parallel ranks if any),
never the TP group.

Sums, counts, maxima and histograms stay tensors on the device of the values added, so accumulating them per
micro-batch reads nothing back to the host; `reduce` (once per step, for logging) all-reduces them on that device
and copies the result to the host once.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

# Quantiles of non-negative values come from a histogram with log-spaced bins, so reducing them over any number of
# ranks is one fixed-size all-reduce: bin 0 holds [0, LO), the last [HI, inf), each other bin spans a factor of
# (HI / LO) ** (1 / (BINS - 2)) ~ 1.037, the relative resolution of a quantile in [LO, HI).
QUANTILE_LO, QUANTILE_HI, QUANTILE_BINS = 1e-6, 1e2, 512


def _histogram_edges(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.logspace(math.log10(QUANTILE_LO), math.log10(QUANTILE_HI), QUANTILE_BINS - 1, dtype=torch.float64,
                          device=device)


def collective_device(group, device: torch.device | str) -> torch.device:
    """The device a collective over `group` runs on: `device` (that of its inputs), except that a CPU tensor bound
    for an NCCL-only group goes to the current CUDA device (gloo reduces CPU and CUDA tensors alike)."""
    device = torch.device(device)
    if group is not None and device.type == "cpu" and dist.get_world_size(group) > 1:
        backend = str(dist.get_backend(group))
        if "nccl" in backend and "gloo" not in backend:
            return torch.device("cuda", torch.cuda.current_device())
    return device


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
    """Named means (sum / count), maxima and quantiles; `reduce` returns plain floats, NaN for an empty mean.

    The `add_*` methods make every tensor on the device of `values` and read none back (no host sync)."""

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
        m = values.max() if values.numel() else values.new_full((), float("-inf"))
        old = self.maxes.get(name)
        self.maxes[name] = m if old is None else torch.maximum(old.to(m.device), m)

    def add_quantile(self, name: str, values: torch.Tensor, where: torch.Tensor | None = None, *, q: float) -> None:
        """Log the q-quantile of non-negative `values` as `<name>_p<100 q>` (e.g. abs_log_ratio_p99).

        A fixed-size histogram (QUANTILE_BINS bins, plus one that counts negative values: `reduce` raises on them,
        so that this method reads nothing back to the host)."""
        values = values.detach().double().reshape(-1)
        w = torch.ones_like(values) if where is None else where.detach().double().reshape(-1)
        bins = torch.bucketize(values, _histogram_edges(values.device), right=True)
        bins = torch.where(values < 0, QUANTILE_BINS, bins)
        hist = torch.zeros(QUANTILE_BINS + 1, dtype=torch.float64, device=values.device).index_add_(0, bins, w)
        key = f"{name}_p{100 * q:g}"
        self.hists[key] = self.hists.get(key, 0) + hist

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

    def to(self, device: torch.device | str) -> Metrics:
        """A copy with every tensor on `device` (one copy per tensor; moving to the CPU syncs with the device). For
        pickling across ranks: a pickled CUDA tensor comes back on the sender's GPU index."""
        out = Metrics()
        for src, dst in ((self.sums, out.sums), (self.counts, out.counts), (self.maxes, out.maxes),
                         (self.hists, out.hists)):
            dst.update({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in src.items()})
        return out

    def _device(self) -> torch.device:
        """The device of the accumulated tensors (the values' device), CPU when none is a tensor."""
        for d in (self.sums, self.counts, self.maxes, self.hists):
            for v in d.values():
                if isinstance(v, torch.Tensor):
                    return v.device
        return torch.device("cpu")

    def reduce(self, group=None, *, device: torch.device | str | None = None) -> dict[str, float]:
        """Means, maxima and quantiles over every rank of `group` (None: this process only), one collective each.

        The collectives run on `device`, by default the device of the accumulated values (CUDA for CUDA
        micro-batches; see `collective_device` for an NCCL-only group), then one copy brings the results to the
        host: call it once per step, for logging."""
        names, maxes, quantiles = sorted(self.sums), sorted(self.maxes), sorted(self.hists)
        device = collective_device(group, self._device() if device is None else device)

        def stack(rows, width):  # [len(rows), width] float64 on `device`
            if not rows:
                return torch.zeros(0, width, dtype=torch.float64, device=device)
            return torch.stack([torch.as_tensor(r, dtype=torch.float64, device=device).reshape(width) for r in rows])

        packed = stack([torch.stack([self.sums[n], self.counts[n]]) for n in names], 2)  # add_mean made both tensors
        mx = stack([self.maxes[n] for n in maxes], 1)
        hists = stack([self.hists[k] for k in quantiles], QUANTILE_BINS + 1)
        if group is not None and dist.get_world_size(group) > 1:
            if names:
                dist.all_reduce(packed, group=group)
            if maxes:
                dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
            if quantiles:
                dist.all_reduce(hists, group=group)
        host = torch.cat([packed.reshape(-1), mx.reshape(-1), hists.reshape(-1)]).cpu()  # the one copy to the host
        packed, mx, hists = host.split([packed.numel(), mx.numel(), hists.numel()])
        out = {n: (s / c if c > 0 else float("nan")) for n, (s, c) in zip(names, packed.view(-1, 2).tolist(),
                                                                           strict=True)}
        out.update({n: (v if v != float("-inf") else float("nan")) for n, v in zip(maxes, mx.tolist(), strict=True)})
        for i, key in enumerate(quantiles):
            hist = hists.view(-1, QUANTILE_BINS + 1)[i]
            negative = float(hist[-1])
            if negative > 0:
                raise ValueError(f"{key.rsplit('_p', 1)[0]}: quantiles are of non-negative values, got {negative:g} "
                                 "negative values")
            out[key] = histogram_quantile(hist[:-1], float(key.rsplit("_p", 1)[1]) / 100)
        return out
