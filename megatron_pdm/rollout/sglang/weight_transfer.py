"""Moving weights from the trainer into rollout engines without a disk round trip: both ends of SGLang's
`/update_weights_from_distributed` (a process group of the trainer, rank 0, and every engine rank, one broadcast
per tensor) and `/update_weights_from_tensor` (tensors pickled with torch's multiprocessing reductions, so that
the engine maps the trainer's memory instead of copying it over HTTP: CUDA IPC handles on a GPU, shared-memory
files on a CPU).

The process group is built the way SGLang builds its side (`init_custom_process_group` in
python/sglang/srt/utils/common.py of SGLang 0.5.23, called by `WeightUpdater.init_weights_update_group` with
`init_method=tcp://master_address:master_port`, `rank = rank_offset + tp_rank`): a TCPStore hosted by rank 0,
`PrefixStore(group_name)` over it, then torch's `_new_process_group_helper`, which adds `PrefixStore(group_name/)`
and `PrefixStore(<device>/)` and publishes the group's sequence number through the store. Both ends must go
through the same layers, or the NCCL unique id (or gloo's addresses) are written under keys the other side never
reads, and the group never forms.
"""

from __future__ import annotations

import base64
import inspect
import io
import ipaddress
import os
import pickle
import pickletools
import socket
from contextlib import contextmanager
from datetime import timedelta
from functools import cache
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from megatron_pdm._bytes import as_bytes

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float8_e4m3fn": torch.float8_e4m3fn, "int32": torch.int32, "int64": torch.int64}
MASTER_ADDRESS_ENV = "MEGATRON_PDM_WEIGHTS_MASTER_ADDRESS"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def custom_process_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                         backend: str = "nccl", timeout_s: float = 600.0):
    """One rank of a process group of its own (not torch's default group, which the trainer uses for training),
    exactly as SGLang's engines build theirs (`init_custom_process_group`):

        store = TCPStore(master_address, master_port, world_size, is_master=rank == 0, multi_tenant=True)
        store = PrefixStore(group_name, store)
        pg = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name)
        # with _world.pg_group_ranks[pg] = identity, so that dist.broadcast(src=0, group=pg) means rank 0

    The engine ranks (rank > 0: `megatron-pdm serve`) get their store from torch's `rendezvous("tcp://...")`, as
    SGLang does. On rank 0 that rendezvous builds the same TCPStore, except under torchrun
    (TORCHELASTIC_USE_AGENT_STORE=True), where it hosts none: the trainer, rank 0 and run by torchrun, builds the
    store directly so that it always hosts it. Rank 0 blocks until all world_size ranks joined (or timeout_s).
    Returns the process group; `destroy_group` releases it."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend: {backend!r} is not nccl or gloo")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore(master_address, int(master_port), world_size, is_master=True, timeout=timeout,
                              multi_tenant=True)
    else:  # SGLang's NetworkAddress.to_tcp(): IPv6 in brackets
        host = f"[{master_address}]" if ":" in master_address else master_address
        store, rank, world_size = next(rendezvous(f"tcp://{host}:{int(master_port)}", rank, world_size,
                                                  timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # torch renamed pg_options to backend_options in 2.6; SGLang picks the name by version the same way
    options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters \
        else "pg_options"
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout, **{options: None})
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg) -> None:
    """Release a group made by `custom_process_group` (as SGLang's /destroy_weights_update_group does)."""
    dist.destroy_process_group(pg)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def trainer_address(urls, override: str | None = None, *, rank0: bool = True) -> str:
    """The address at which the engines at `urls` reach a trainer rank's process group store, in order:
    `override`; $MEGATRON_PDM_WEIGHTS_MASTER_ADDRESS; 127.0.0.1 when every engine is on this host's loopback;
    $MASTER_ADDR (the rendezvous host, where torchrun and the Slurm script run rank 0) unless it is a loopback
    address; the local address of the route to the first engine; this host's name. rank0 False (a later pipeline
    stage's sender, maybe on another node): the override, the variable and $MASTER_ADDR, which name rank 0's host,
    are skipped."""
    if override and rank0:
        return override
    if os.environ.get(MASTER_ADDRESS_ENV) and rank0:
        return os.environ[MASTER_ADDRESS_ENV]
    hosts = [urlparse(u).hostname or "" for u in urls]
    if hosts and all(is_loopback(h) for h in hosts):
        return "127.0.0.1"
    master = os.environ.get("MASTER_ADDR", "") if rank0 else ""
    if master and not is_loopback(master):
        return master
    for host in hosts:
        if host and not is_loopback(host):
            try:  # no packet is sent: connecting a UDP socket only picks the route and its local address
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.connect((host, 9))
                    return s.getsockname()[0]
            except OSError:
                break
    return socket.gethostname()


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


def start_broadcast(pg, tensors: list[torch.Tensor]) -> list:
    """One broadcast per tensor from rank 0, the trainer, all in flight at once (SGLang's receiving side:
    `dist.broadcast(torch.empty(shape, dtype), src=0, group=pg, async_op=True)` per announced tensor): their works,
    not waited for."""
    gloo = dist.get_backend(pg) == "gloo"
    return [dist.broadcast(_wire(t, gloo), src=0, group=pg, async_op=True) for t in tensors]


def broadcast_tensors(pg, tensors: list[torch.Tensor]) -> None:
    """`start_broadcast`, waited for (every rank's side of it)."""
    for w in start_broadcast(pg, tensors):
        w.wait()


def abort_group(pg) -> None:
    """Give up a group with collectives in flight: NCCL's is aborted (its kernels stop; a member that never joins
    would otherwise hold rank 0 forever). gloo's is left alone, not waited for: its pending work ends with the
    group's timeout in gloo's own threads (aborting it would wait for that)."""
    if dist.get_backend(pg) == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group(pg)


def _wire(t: torch.Tensor, gloo: bool) -> torch.Tensor:
    """float8 travels over gloo as its bytes (gloo has no float8 type; a broadcast copies bytes whatever they mean);
    NCCL sends it as it is."""
    return as_bytes(t) if gloo and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def receive_tensors(pg, names: list[str], dtypes: list[str], shapes: list[list[int]], device="cpu"):
    """The receiving side of `broadcast_tensors`: [(name, tensor)] in the announced order."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes, shapes: lengths {len(names)}, {len(dtypes)}, {len(shapes)} differ")
    bad = [d for d in dtypes if d not in DTYPE_NAMES]
    if bad:
        raise ValueError(f"dtypes: {bad[0]!r} is not one of {', '.join(DTYPE_NAMES)}")
    tensors = [torch.empty(list(s), dtype=DTYPE_NAMES[d], device=device) for d, s in zip(dtypes, shapes, strict=True)]
    broadcast_tensors(pg, tensors)
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


def _inheritable_fds() -> list[int]:
    """This process's open file descriptors above 2 that a child it execs would inherit (Linux: /proc/self/fd;
    multiprocessing's spawn sentinel, and what C++ libraries such as gloo open without O_CLOEXEC)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return []
    found = []
    for fd in fds:
        try:
            if fd > 2 and os.get_inheritable(fd):
                found.append(fd)
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return found


@cache
def detached_shm_manager() -> None:
    """Start torch's `torch_shm_manager` daemon for this process holding none of its file descriptors. torch starts
    it at a process's first file_system share by fork and exec, so it inherited stdin, stderr (it replaces stdout
    only) and every inheritable descriptor, and it lives while any process maps one of its files (an engine holding
    the weights): `megatron-pdm train 2>&1 | tee log` waited for it after the run ended, and so did the trainer's
    own launcher, whose rank processes' spawn sentinels it held. Here that first share (one element) is made with
    fds 0-2 on /dev/null and every other descriptor close-on-exec for the moment (then restored); what another thread
    writes to fds 0-2 or execs meanwhile (one fork and exec) sees them so. Once per process."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    saved = {}
    for fd in (0, 1, 2):
        try:
            saved[fd] = os.dup(fd)
        except OSError:  # closed: nothing to inherit
            pass
    hidden = _inheritable_fds()
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in hidden:
            os.set_inheritable(fd, False)
        for fd in saved:
            os.dup2(null, fd)
        with _sharing_by_file():
            torch.zeros(1).share_memory_()
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)
        for fd in hidden:
            os.set_inheritable(fd, True)


def shared(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """CUDA tensors as they are; a fresh shared-memory copy of each CPU tensor (a storage shared before may have
    lost its name: the name goes when the last reader of a pickle made of it lets go), made after torch's
    shared-memory daemon was started holding none of our streams (`detached_shm_manager`)."""
    if any(not t.is_cuda for _, t in named):
        detached_shm_manager()
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


# Every dtype a weight update can carry: dtypes pickle as globals (`torch.float32`), and are values, not callables.
TENSOR_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
                 torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
# Opcodes that build objects otherwise than by calling an admitted global (BUILD sets state on one: __setstate__ or
# attributes; NEWOBJ calls cls.__new__), or that fetch objects by other means (extensions, persistent ids). The
# sender's payloads have none of them.
REFUSED_OPCODES = frozenset({"BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4", "PERSID",
                             "BINPERSID"})


@cache
def admitted_globals() -> dict[tuple[str, str], object]:
    """(module, name) -> object for exactly the globals in what `serialize_named_tensors` sends, as logged from its
    payloads (every dtype of TENSOR_DTYPES; empty, 0-d and strided tensors) and read off torch's `reduce_tensor`:

    - CPU tensors (file_system sharing, which the sender always sets): `rebuild_tensor(torch.Tensor,
      rebuild_typed_storage(rebuild_storage_filename(torch.storage.UntypedStorage, manager, handle, size), dtype),
      (offset, torch.Size(...), stride, requires_grad))`;
    - CUDA tensors (IPC handles, as SGLang receives them): `rebuild_cuda_tensor(torch.Tensor, torch.Size(...),
      stride, offset, torch.storage.TypedStorage, dtype, device, handle, ...)`.

    Not admitted: `rebuild_storage_fd` (the file_descriptor strategy, which the sender never uses: its
    `multiprocessing.resource_sharer.DupFd` argument connects to an address taken from the payload),
    `rebuild_storage_empty`, `torch._utils._rebuild_tensor_v2` and the rest of torch.save's format, builtins,
    collections, and any other name in torch (torch.load, torch.serialization.*, torch._C, torch.jit, ...)."""
    from torch.multiprocessing import reductions

    admitted = {("torch.multiprocessing.reductions", f.__name__): f
                for f in (reductions.rebuild_tensor, reductions.rebuild_typed_storage,
                          reductions.rebuild_storage_filename, reductions.rebuild_cuda_tensor)}
    admitted |= {("torch.storage", "UntypedStorage"): torch.storage.UntypedStorage,
                 ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
                 ("torch", "Tensor"): torch.Tensor, ("torch", "Size"): torch.Size}
    admitted |= {("torch", dtype_name(d)): d for d in TENSOR_DTYPES}
    return admitted


class _TensorUnpickler(pickle.Unpickler):
    """Unpickles only what `serialize_named_tensors` sends: a global outside `admitted_globals` (looked up by its
    exact module and name: nothing is imported or looked up by attribute) is refused before anything calls it."""

    def find_class(self, module, name):
        try:
            return admitted_globals()[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in serialized_named_tensors") \
                from None

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not allowed in serialized_named_tensors")


def _refuse_opcodes(raw: bytes) -> None:
    try:
        for op, _, pos in pickletools.genops(raw):
            if op.name in REFUSED_OPCODES:
                raise pickle.UnpicklingError(f"opcode {op.name} (at byte {pos}) is not allowed in "
                                             "serialized_named_tensors")
    except (ValueError, EOFError) as e:  # malformed: not a pickle the sender made
        raise pickle.UnpicklingError(f"serialized_named_tensors: not a well-formed pickle ({e})") from None


def deserialize_named_tensors(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `serialize_named_tensors`, which never runs code from `data`: only the globals that the sender
    uses are admitted (`admitted_globals`), by exact name, and object-building opcodes are refused; anything else
    raises pickle.UnpicklingError before a refused global is called (`serve` answers HTTP 400). What remains is what
    the protocol does: map shared-memory files or CUDA IPC handles named by the payload."""
    raw = base64.b64decode(data) if isinstance(data, str) else data
    _refuse_opcodes(raw)
    named = _TensorUnpickler(io.BytesIO(raw)).load()
    if not isinstance(named, list) or not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                                              and isinstance(x[1], torch.Tensor) for x in named):
        raise ValueError("serialized_named_tensors: expected a list of (name, tensor) pairs")
    return named
