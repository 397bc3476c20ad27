import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

_POOLS = {}


@pytest.fixture(scope="session")
def dist_pools():
    """Gloo worker pools keyed by world size, started on first use and shared by the whole session."""
    from tests.distributed import DistPool

    class Pools:
        def __call__(self, world):
            if world not in _POOLS:
                _POOLS[world] = DistPool(world)
            return _POOLS[world]

    yield Pools()
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
