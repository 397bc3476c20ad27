"""A pool of gloo worker processes that run test functions on every rank.

Spawning processes and importing torch costs seconds, so each world size is started once per test session
and reused: `pool.run(fn, *args)` pickles a module-level function and its arguments to every rank, runs
`fn(group, *args)` there (group = the world's gloo group) and returns the list of per-rank results.
An exception on any rank fails the call with that rank's traceback.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import socket
import traceback

TIMEOUT_S = 300


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
            conn.send(("ok", fn(group, *args)))
        except BaseException:  # noqa: BLE001 - the traceback goes back to the test
            conn.send(("error", traceback.format_exc()))
        gc.collect()  # the last test's reference cycles freed, with the gloo groups (and their threads) they hold
    dist.destroy_process_group()
    import multiprocessing

    for child in multiprocessing.active_children():  # megatron's checkpoint writers would hold the exit until killed
        child.terminate()


class DistPool:
    def __init__(self, world: int):
        self.world = world
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.conns, self.procs = [], []
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
            status, value = conn.recv()
            (results if status == "ok" else errors).append(value if status == "ok" else f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return results

    def close(self, force: bool = False) -> None:
        for conn in self.conns:
            if not force:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for p in self.procs:
            p.join(timeout=10 if not force else 0)
            if p.is_alive():
                p.kill()
