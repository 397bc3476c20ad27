"""A pool of gloo worker processes that run test functions on every rank.

Spawning processes and importing torch costs seconds, so each world size is started once per test session
and reused: `pool.run(fn, *args)` pickles a module-level function and its arguments to every rank, runs
`fn(group, *args)` there (group = the world's gloo group) and returns the list of per-rank results.
An exception on any rank fails the call with that rank's traceback.

A worker outlives many tests, so after each call it tears down megatron's parallel state if the call left it
set (a test that raised mid-run) and reports its native thread count. Training runs that save a checkpoint with
the distributed optimizer or an MoE model leave ~17 gloo groups per rank alive past `destroy_parallel` (their
owner is not a Python object we could reach from gc: measured, 51 threads a run), and every idle gloo group polls:
a worker at 160 threads burned 6.5% of a core doing nothing, at 830 (what a full session reached) a third of one,
which made the suite's distributed tests 3-5x slower than alone. `needs_restart` tells the session fixture to
replace such a pool: workers fork from a preloaded server (`_context`), so a new pool answers in ~0.4 s, where
spawned workers took ~5 s plus ~10 s for the first test's imports.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import socket
import sys
import traceback

TIMEOUT_S = 300
RESTART_AT_THREADS = 100  # an idle worker has ~8 native threads; each leaked gloo group adds 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, conn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the test process is gone
            break
        if msg is None:
            break
        fn, args = msg
        try:
            reply = ("ok", fn(group, *args))
        except BaseException:  # noqa: BLE001 - the traceback goes back to the test
            reply = ("error", traceback.format_exc())
        _release_parallel_state()
        gc.collect()  # the last test's reference cycles freed, with the gloo groups (and their threads) they hold
        conn.send((*reply, len(os.listdir("/proc/self/task"))))
    dist.destroy_process_group()
    import multiprocessing

    for child in multiprocessing.active_children():  # megatron's checkpoint writers would hold the exit until killed
        child.terminate()


_PRELOAD = ["tests._forkserver_preload"]


def _context():
    """Workers are forked from one server process that imported torch, megatron-core and the trainer once
    (multiprocessing's forkserver, preloaded by `tests/_forkserver_preload.py`, which also freezes what it imported):
    a new pool answers in ~0.4 s instead of each rank importing for ~10 s, which is what lets a pool with leaked groups
    be replaced cheaply. The server itself starts no thread pool or process group (those start in the workers)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _release_parallel_state() -> None:
    """megatron's parallel state destroyed if the call left it initialised (it raised before its own teardown)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        from megatron_pdm.models import destroy_parallel

        destroy_parallel()


class DistPool:
    def __init__(self, world: int):
        self.world = world
        ctx = _context()
        port = _free_port()
        self.conns, self.procs = [], []
        self.threads = 0  # the most native threads any worker reported after a call
        for rank in range(world):
            parent, child = ctx.Pipe()
            # not daemonic: megatron's checkpoint writer forks its own writer processes
            p = ctx.Process(target=_worker, args=(rank, world, port, child), daemon=False)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, fn, *per_rank_args, shared=()):
        """Run fn(group, *shared, *per_rank_args[rank]) on each rank; per_rank_args is a list over ranks
        (or empty). Returns the list of results in rank order."""
        for rank, conn in enumerate(self.conns):
            args = tuple(shared) + (tuple(per_rank_args[0][rank]) if per_rank_args else ())
            conn.send((fn, args))
        results, errors = [], []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(TIMEOUT_S):
                self.close(force=True)
                raise TimeoutError(f"rank {rank} did not answer within {TIMEOUT_S}s")
            status, value, threads = conn.recv()
            self.threads = max(self.threads, threads)
            (results if status == "ok" else errors).append(value if status == "ok" else f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return results

    @property
    def needs_restart(self) -> bool:
        return self.threads > RESTART_AT_THREADS

    def retire(self) -> None:
        """Ask every worker to exit and return at once: a worker holding leaked gloo groups takes seconds to tear
        them down at exit, and nothing waits for that (`close` reaps it later)."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        self.conns = []

    def close(self, force: bool = False, wait_s: float = 10) -> None:
        if not force:
            self.retire()
        for p in self.procs:
            p.join(timeout=0 if force else wait_s)
            if p.is_alive():
                p.kill()
