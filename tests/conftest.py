import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _interpret_triton_without_a_gpu():
    """Without CUDA, Triton kernels run under Triton's interpreter (decided when a kernel is defined, so before
    any test imports one). Only tests/test_kernels.py launches them on a CPU; the library never does."""
    import importlib.util

    import torch

    if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_a_gpu()

@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Every test starts from one fixed global RNG state (torch, random): its unseeded draws (`torch.randn(T)`,
    `make_case` without a seed) are the same in every run and whatever ran before it, so no test passes or fails
    by chance."""
    import random

    import torch

    torch.manual_seed(0)
    random.seed(0)


def pytest_collection_finish(session):
    """Every test module is imported (torch, transformers, megatron_pdm): frozen (`gc.freeze`), those objects leave the
    full collections of this process (Python's own, megatron's at each checkpoint save), which scanned them all."""
    import gc

    gc.collect()  # no garbage frozen with the rest
    gc.freeze()


_POOLS = {}
_RETIRED = []  # replaced pools, exiting in the background until the session ends


@pytest.fixture(scope="session")
def dist_pools():
    """Gloo worker pools keyed by world size, started on first use and shared by the whole session; a pool whose
    workers hold leaked gloo groups (`DistPool.needs_restart`) is replaced by a fresh one."""
    from tests.distributed import DistPool

    class Pools:
        def __call__(self, world):
            if world in _POOLS and _POOLS[world].needs_restart:
                _POOLS[world].retire()
                _RETIRED.append(_POOLS.pop(world))
            if world not in _POOLS:
                _POOLS[world] = DistPool(world)
            return _POOLS[world]

    yield Pools()
    pools = [*_RETIRED, *_POOLS.values()]
    for pool in pools:
        pool.retire()  # every worker exits at once, then each is waited for (killed if it takes over 10 s)
    for pool in pools:
        pool.close(wait_s=10)
    _POOLS.clear()
    _RETIRED.clear()
