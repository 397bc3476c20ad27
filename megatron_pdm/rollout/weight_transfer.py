"""Moving weights from the trainer into rollout engines without a disk round trip: both ends of SGLang's
`/update_weights_from_distributed` (a process group of the trainer, rank 0, and every engine rank, one broadcast
per tensor) and `/update_weights_from_tensor` (tensors pickled with torch's multiprocessing reductions, so that
the engine maps the trainer's memory instead of copying it over HTTP: CUDA IPC handles on a GPU, shared-memory
files on a CPU).
"""

from __future__ import annotations

import base64
import io
import pickle
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float8_e4m3fn": torch.float8_e4m3fn, "int32": torch.int32, "int64": torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weights_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                  backend: str = "nccl", timeout_s: float = 600.0):
    """A process group of its own (not torch's default group, which the trainer uses for training) over a
    TCPStore at master_address:master_port, hosted by rank 0 (the trainer). It blocks until all world_size
    ranks joined."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend: {backend!r} is not nccl or gloo")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    else:
        group = dist.ProcessGroupNCCL(store, rank, world_size)
    return WeightsGroup(group, store)


class WeightsGroup:
    """A process group and the store it rendezvoused through (which must outlive it)."""

    def __init__(self, group, store):
        self.group, self.store = group, store


def buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """The names of `state` in order, cut into runs of at most bucket_bytes (a larger tensor is a bucket alone)."""
    out, cur, size = [], [], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nbytes
    return out + ([cur] if cur else [])


def broadcast_tensors(group, tensors: list[torch.Tensor]) -> None:
    """One broadcast per tensor from rank 0, the trainer (the receivers pass empty tensors of the announced dtype
    and shape), all in flight at once."""
    works = [group.group.broadcast(_wire(t), 0) for t in tensors]
    for w in works:
        w.wait()


def _wire(t: torch.Tensor) -> torch.Tensor:
    """float8 travels as its bytes (gloo has no float8 type; a broadcast copies bytes whatever they mean)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def receive_tensors(group, names: list[str], dtypes: list[str], shapes: list[list[int]], device="cpu"):
    """The receiving side of `broadcast_tensors`: [(name, tensor)] in the announced order."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes, shapes: lengths {len(names)}, {len(dtypes)}, {len(shapes)} differ")
    bad = [d for d in dtypes if d not in DTYPE_NAMES]
    if bad:
        raise ValueError(f"dtypes: {bad[0]!r} is not one of {', '.join(DTYPE_NAMES)}")
    tensors = [torch.empty(list(s), dtype=DTYPE_NAMES[d], device=device) for d, s in zip(dtypes, shapes, strict=True)]
    broadcast_tensors(group, tensors)
    return list(zip(names, tensors, strict=True))


@contextmanager
def _sharing_by_file():
    """CPU tensors travel as named shared-memory files while pickling: the default strategy passes file
    descriptors, which only processes forked from the sender can receive."""
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def shared(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """CUDA tensors as they are; a fresh shared-memory copy of each CPU tensor (a storage shared before may have
    lost its name: the name goes when the last reader of a pickle made of it lets go)."""
    with _sharing_by_file():
        return [(n, t if t.is_cuda else t.clone().share_memory_()) for n, t in named]


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """base64 of the pickled [(name, tensor)] with torch's multiprocessing reductions (SGLang's
    MultiprocessingSerializer format) for one receiver, which maps the same memory: CUDA tensors, or CPU tensors
    made by `shared`. Each pickle is good for one reader (it holds one reference to the shared storage); the
    sender keeps the tensors alive until the receiver has loaded them."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the tensor reductions with ForkingPickler)

    buf = io.BytesIO()
    with _sharing_by_file():
        ForkingPickler(buf).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode()


def deserialize_named_tensors(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `serialize_named_tensors`. It unpickles: accept it only from the trainer (as SGLang does)."""
    import torch.multiprocessing  # noqa: F401

    raw = base64.b64decode(data) if isinstance(data, str) else data
    named = pickle.loads(raw)
    if not isinstance(named, list) or not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                                              and isinstance(x[1], torch.Tensor) for x in named):
        raise ValueError("serialized_named_tensors: expected a list of (name, tensor) pairs")
    return named
