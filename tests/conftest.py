import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# megatron-core 0.17+ runs `git rev-parse` in a subprocess at import unless set (compat patch 8 sets it too, for the
# processes that import megatron through it): a test that imports megatron first would start a process
os.environ.setdefault("NO_VCS_VERSION", "1")


def _interpret_triton_without_a_gpu():
    """Without CUDA, Triton kernels run under Triton's interpreter (decided when a kernel is defined, so before
    any test imports one). Only tests/vocab_parallel/test_kernels.py launches them on a CPU; the library never does."""
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


# the real-SGLang tier (`make test-sglang`): the CPU engine environment's python (`make engine-env-cpu`)
SGLANG_PYTHON_ENV = "MEGATRON_PDM_SGLANG_PYTHON"


def pytest_collection_modifyitems(items):
    """The suite's three tiers, one marker each (`pytest -m unit`, `-m distributed`, `-m e2e`): e2e where the test
    module marks it (a subprocess, a server, a Slurm script or a CLI entry point); distributed for a test that takes
    the gloo pools (`dist_pools`); unit for every other test. Tests marked sglang_real (real SGLang servers, e2e
    too) are skipped unless $MEGATRON_PDM_SGLANG_PYTHON names the engine environment's python."""
    real = os.environ.get(SGLANG_PYTHON_ENV)
    for item in items:
        if item.get_closest_marker("sglang_real") is not None and not real:
            item.add_marker(pytest.mark.skip(reason=f"real SGLang: set {SGLANG_PYTHON_ENV} (make test-sglang)"))
        if item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.distributed if "dist_pools" in item.fixturenames else pytest.mark.unit)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """A unit test that starts a process (subprocess or multiprocessing) fails at that call, naming its tier: the
    tiers stay what they say."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} is in the unit tier but starts a process: mark it "
                             "@pytest.mark.e2e (or run its ranks in dist_pools)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield


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
