"""The worker pool's faults, without a server: fake engines answer `pool.post` in-process (launched ones are
`EngineProcess`es whose start and health wait are stubbed, or a `sleep` standing in for the server), so each test
reproduces one race or failure exactly, in well under a second. Regressions of a review of `megatron_pdm/rollout/`:
an engine restarted during an update left out of service but running, a restart failing outside its start-up
holding `settle` forever, engines outliving a rank ended by SIGTERM, the distributed transport on NCCL for our own
server, and `generate` waiting for every request in flight after one failed."""

import errno
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from megatron_pdm.rollout import SamplingParams
from megatron_pdm.rollout.sglang import launcher as launcher_module
from megatron_pdm.rollout.sglang import pool as pool_module
from megatron_pdm.rollout.sglang import transports
from megatron_pdm.rollout.sglang.client import SGLangEngine
from megatron_pdm.rollout.sglang.launcher import EngineProcess, LaunchSpec, Router
from megatron_pdm.rollout.sglang.pool import Rejected, WorkerError, WorkerPool
from megatron_pdm.rollout.sglang.wire import SERVE_VERSION
from tests.helpers import DENSE, sglang_section


def _launched_pool(tmp_path, num_engines: int) -> WorkerPool:
    """A pool of `num_engines` launched engines, in service at version 0 from an export, whose (re)starts only count
    and whose health waits return at once."""
    spec = LaunchSpec(server="megatron-pdm", num_engines=num_engines, log_dir=tmp_path)
    pool = WorkerPool([], launch=spec, router=False, timeout=1, retries=0, backoff=0, max_restarts=2, inflight=1)
    pool.alive, pool.export, pool.weight_version = list(pool.urls), (tmp_path / "v0", 0), 0
    for p in pool.procs.values():
        p.starts = 1
        p.start = lambda path, version, p=p: setattr(p, "starts", p.starts + 1)
        p.wait_ready = lambda: None
    return pool


class _Router:
    """What the pool asks of sglang-router: add and remove engines (recorded)."""

    def __init__(self):
        self.added, self.removed = [], []

    def add(self, url):
        self.added.append(url)

    def remove(self, url):
        self.removed.append(url)


def test_an_engine_restarted_during_an_update_waits_in_stale_and_rejoins_at_the_next(tmp_path, monkeypatch):
    """Regression: engine a died while the trainer trained (its /pause_generation is refused) and its restart, from
    the version-0 export, finished while the other engine loaded version 1. It counted itself current (the pool was
    still at version 0), joined `alive` and the router, and then the update's end overwrote `alive`: a running engine
    in none of alive / stale / restarts, holding a GPU and, behind the router, answering with version 0. It waits in
    `stale` (not routed to) and rejoins at the next update."""
    pool = _launched_pool(tmp_path, 2)
    pool.router = router = _Router()
    a, b = pool.urls
    calls, dead = [], {a}

    def post(url, path, body, timeout):
        calls.append((url, path))
        if url in dead and path == "/pause_generation":
            dead.discard(url)  # the restarted one answers
            raise WorkerError(f"{url}{path}: connection refused", (url,))
        return {"success": True}

    def send(targets):  # the other engine loads while a's restart finishes (it may already have: no lookup)
        assert targets == [b]
        deadline = time.monotonic() + 5
        while a not in pool.stale and time.monotonic() < deadline:
            time.sleep(0.01)

    monkeypatch.setattr(pool_module, "post", post)
    pool.update(1, send)
    assert pool.weight_version == 1 and pool.alive == [b] and pool.stale == [a] and not pool.restarts
    assert a not in router.added and router.added == [b]  # never routed to at version 0
    assert not pool.updating

    del calls[:]
    pool.update(2, lambda targets: None)  # the next update reaches it
    assert pool.alive == [b, a] and pool.stale == [] and router.added[-1] == a and pool.weight_version == 2
    assert (a, "/pause_generation") in calls and (a, "/continue_generation") in calls


def test_a_restart_failing_outside_its_start_up_drops_the_engine_and_settle_returns(tmp_path, caplog):
    """Regression: a restart raising anything but TimeoutError / RuntimeError (here an OSError writing the engine
    log on a full disk) left its finished future in `restarts`: `settle` and `generate` spun at 100% CPU forever and
    `failed` ignored the engine. The engine is dropped (a new start would meet the same error), with the error
    named; a finished restart left in `restarts` (one `stop_restarts` cancelled) holds nothing either."""
    pool = _launched_pool(tmp_path, 1)
    (url,) = pool.urls
    proc = pool.procs[url]

    def start(path, version):
        raise OSError(errno.ENOSPC, "No space left on device")

    proc.start = start
    submitted, submit = [], pool._restart_pool.submit  # the restart's future (it may leave `restarts` at once)
    pool._restart_pool.submit = lambda *a, **k: submitted.append(submit(*a, **k)) or submitted[-1]
    pool.failed(url, "process exited")
    settled = threading.Thread(target=pool.settle, daemon=True)
    settled.start()
    settled.join(2)
    assert not settled.is_alive(), "settle still waiting"
    submitted[0].result(timeout=5)  # its drop (failed(), the log line) comes after it left `restarts`
    assert url not in pool.restarts and url not in pool.alive and url not in pool.stale
    assert "dropping SGLang worker" in caplog.text and "OSError: [Errno 28] No space left on device" in caplog.text
    assert "(no restarts left)" not in caplog.text

    cancelled = Future()
    cancelled.cancel()
    pool.restarts[url] = cancelled  # as stop_restarts leaves a restart that had not begun
    pool.settle()
    assert not pool.restarts


@pytest.mark.e2e
def test_sigterm_in_a_rank_runs_its_finally_blocks_and_stops_the_engines(tmp_path, monkeypatch):
    """Regression: engines run in sessions of their own, so a rank killed by SIGTERM's default action (torch's spawn
    join ends the surviving ranks so after one failed; torchrun and Slurm too) never ran `engine.close()` and its
    engines kept their GPU memory and ports. Inside `sigterm_exits` SIGTERM raises SystemExit: the `finally` stops
    the engine (a `sleep` standing in for it); the handler before is restored on the way out."""
    from megatron_pdm.train.launch import sigterm_exits

    monkeypatch.setattr(LaunchSpec, "command", lambda self, i, path, port, v: ["sleep", "30"])
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what a rank starts with
    try:
        engine = EngineProcess(LaunchSpec(server="megatron-pdm", log_dir=tmp_path), 0)
        with pytest.raises(SystemExit) as exited, sigterm_exits():
            try:
                engine.start(str(tmp_path), 0)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # interrupted by the handler
            finally:
                proc = engine.proc
                engine.stop()
        assert exited.value.code == 128 + signal.SIGTERM
        assert proc.poll() is not None and engine.proc is None  # the engine did not outlive the rank
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.e2e
def test_a_router_that_fails_to_start_in_any_way_is_killed(tmp_path, monkeypatch):
    """Regression: Router killed its process only on TimeoutError / RuntimeError; a malformed /workers answer
    (KeyError) or an unreachable one (URLError) left sglang-router running in its own session. (A `sleep` stands in
    for the router.)"""
    started, popen = [], subprocess.Popen

    def fake_router(cmd, **kw):
        started.append(popen(["sleep", "30"], **kw))
        return started[-1]

    monkeypatch.setattr(launcher_module.subprocess, "Popen", fake_router)
    monkeypatch.setattr(launcher_module, "wait_healthy", lambda *a, **k: None)
    monkeypatch.setattr(Router, "workers", lambda self: {}["workers"])
    with pytest.raises(KeyError, match="workers"):
        Router(["http://127.0.0.1:1"], log_dir=tmp_path)
    assert len(started) == 1 and started[0].poll() is not None


def test_the_distributed_transport_takes_gloo_for_our_server_and_nccl_for_sglang(tmp_path, monkeypatch):
    """Regression: under CUDA the distributed transport was NCCL whatever the engines, but `megatron-pdm serve`
    receives into CPU tensors: rollout.sglang.server=megatron-pdm rollout.sglang.weight_sync=distributed failed on every
    GPU host.
    Gloo for our server (launched: the launch spec says so; attached: /server_info's version), NCCL for SGLang.
    (torch.cuda.is_available is faked; CUDA is not touched.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def launched(server):
        spec = LaunchSpec(server=server, log_dir=tmp_path)
        return SGLangEngine(sglang_section(num_engines=1, server=server, weight_sync="distributed"), DENSE,
                            weight_dir=tmp_path, launch=spec).transports["distributed"].backend

    assert launched("megatron-pdm") == "gloo" and launched("sglang") == "nccl"

    (tmp_path / "config.json").write_text("{}")  # an unquantized checkpoint
    monkeypatch.setattr("megatron_pdm.rollout.sglang.client.wait_healthy", lambda *a, **k: None)

    def attached(version, sync_backend=None):
        monkeypatch.setattr(transports, "get_info", lambda url, name, timeout: {
            "model_path": str(tmp_path), "quantization": None, "version": version})
        engine = SGLangEngine(sglang_section(urls=["http://127.0.0.1:1"], weight_sync="distributed"), DENSE,
                              weight_dir=tmp_path, sync_backend=sync_backend)
        engine.wait_ready()
        return engine.transports["distributed"].backend

    assert attached(SERVE_VERSION) == "gloo" and attached("0.5.2") == "nccl"
    assert attached(SERVE_VERSION, sync_backend="nccl") == "nccl"  # given: kept


def test_close_stops_the_workers_whatever_a_weights_group_teardown_raises(tmp_path):
    """Regression (review of the SIGTERM path): close() destroyed the weights groups, then stopped the workers, with
    nothing between: a teardown that raised (or a second SIGTERM interrupting it) left every launched engine
    running. The workers are stopped whatever happens before."""
    engine = SGLangEngine(sglang_section(num_engines=1, server="megatron-pdm", weight_sync="distributed"), DENSE,
                          weight_dir=tmp_path, launch=LaunchSpec(server="megatron-pdm", log_dir=tmp_path))
    stopped = []

    def teardown_fails():
        raise RuntimeError("destroy_process_group: communicator in use")

    engine.transports["distributed"].close = teardown_fails
    engine.pool.close = lambda: stopped.append(True)
    with pytest.raises(RuntimeError, match="communicator in use"):
        engine.close()
    assert stopped == [True]


def _generate_pool(monkeypatch, answer):
    """Two attached engines, one request in flight each; `answer(url, body)` is what /generate returns."""
    monkeypatch.setattr(pool_module, "post", lambda url, path, body, timeout: answer(url, body))
    return WorkerPool(["http://e0:1", "http://e1:1"], launch=None, router=False, timeout=30, retries=0, backoff=0,
                      max_restarts=0, inflight=1)


def test_generate_raises_at_once_when_a_request_fails_or_the_pool_closes(monkeypatch):
    """Regression: `generate` ran its requests in a `with ThreadPoolExecutor`, so a request that failed (here a
    malformed answer) raised only once every other request in flight had ended (up to timeout_s +
    max_new_tokens / tokens_per_s, ~19 minutes). It raises at once, and once the pool is closed within about a second;
    the successful path keeps its results in prompt order."""
    params = SamplingParams(max_new_tokens=4, n=1, seed=3)
    prompts = [[1], [2]]
    release = threading.Event()

    def slow_or_malformed(url, body):
        if body["input_ids"] == [1]:
            return {"malformed": True}
        release.wait(10)
        return {"row": 1}

    def parse(out, i):
        if "row" not in out:
            raise ValueError(f"generate output for prompt {i}: no row")
        return (i, out["row"])

    try:
        pool = _generate_pool(monkeypatch, slow_or_malformed)
        start = time.monotonic()
        with pytest.raises(ValueError, match="prompt 0: no row"):
            pool.generate(prompts, params, parse)
        assert time.monotonic() - start < 5.0  # the fault: ~10 s (the other request's release.wait(10))

        in_flight = threading.Semaphore(0)

        def slow(url, body):
            in_flight.release()
            release.wait(10)
            return {"row": 1}

        pool = _generate_pool(monkeypatch, slow)
        closer = threading.Thread(target=lambda: (in_flight.acquire(timeout=5), in_flight.acquire(timeout=5),
                                                  pool.stop_restarts()))
        closer.start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="closed; 2 requests unanswered"):
            pool.generate(prompts, params, parse)
        assert time.monotonic() - start < 5.0  # the loop notices within its 1 s wait; the fault: ~10 s
        closer.join(5)
    finally:
        release.set()

    pool = _generate_pool(monkeypatch, lambda url, body: {"row": body["input_ids"][0] * 10})
    assert pool.generate([[3], [1], [2]], params, parse) == [(0, 30), (1, 10), (2, 20)]


def test_a_leftover_session_whose_end_is_refused_keeps_the_engine(tmp_path, monkeypatch):
    """Regression (review): a trainer that died between an FP8 weight's q and its scale leaves serve a session
    holding half a weight; the next trainer's begin is refused, and the `end` the pool then sends answers 400
    (serve closes the session all the same). That refusal dropped a healthy engine; it is logged, and the begin
    that follows decides."""
    url = "http://e0:1"
    sessions = {url: "open, half a weight held"}

    def post(u, path, body, timeout):
        if path == "/begin_weight_update":
            if sessions.get(u):
                raise Rejected(f"{u}{path}: HTTP 400: a weight-update session is already open", 400)
            sessions[u] = "open"
        elif path == "/end_weight_update":
            held, sessions[u] = sessions[u], None
            if "half" in (held or ""):
                raise Rejected(f"{u}{path}: HTTP 400: end_weight_update: no w_scale_inv", 400)
        return {"success": True}

    monkeypatch.setattr(pool_module, "post", post)
    pool = WorkerPool([url], launch=None, router=False, timeout=5, retries=0, backoff=0, max_restarts=0, inflight=1)
    pool.update(1, lambda targets: None, session=True)
    assert pool.alive == [url] and pool.weight_version == 1 and sessions[url] is None
