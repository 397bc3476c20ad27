"""Peak resident memory of a call, and the bytes a rank moves, for memory-bound tests and benchmarks (Linux)."""

from __future__ import annotations

import ctypes
import gc
from contextlib import contextmanager
from pathlib import Path

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def return_freed_memory(threshold: int = 64 << 10) -> None:
    """Make glibc serve every allocation of `threshold` bytes or more by mmap, and so give it back to the OS at
    free (a fixed threshold also stops glibc from raising it as large blocks are freed): resident memory then
    follows the live tensors instead of the allocator's high-water mark."""
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_extra_bytes(fn) -> int:
    """The peak resident memory while `fn()` runs, minus the resident memory before (bytes): /proc/self/status
    VmHWM after resetting it (writing 5 to /proc/self/clear_refs), so the kernel tracks the peak, not a sampler."""
    return_freed_memory()
    gc.collect()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    fn()
    peak = _status("VmHWM")
    gc.collect()
    return peak - before


@contextmanager
def moved_bytes():
    """{"gathered": bytes this rank receives by dist.gather (every shard but its own), "sent": bytes it sends by
    dist.send} while inside, counted where the calls are made (the weight sync's gathers and stage relays)."""
    import torch.distributed as dist

    moved = {"gathered": 0, "sent": 0}
    real_gather, real_send = dist.gather, dist.send

    def gather(t, gather_list=None, *args, **kwargs):
        moved["gathered"] += sum(x.numel() * x.element_size() for x in (gather_list or [])[1:])
        return real_gather(t, gather_list, *args, **kwargs)

    def send(t, *args, **kwargs):
        moved["sent"] += t.numel() * t.element_size()
        return real_send(t, *args, **kwargs)

    dist.gather, dist.send = gather, send
    try:
        yield moved
    finally:
        dist.gather, dist.send = real_gather, real_send
