"""The SGLang worker pool: which workers serve, where each request goes, and what happens when one fails.

Workers are attached (`urls`) or launched (`launch`, started from the first disk export). Requests go to
sglang-router when asked for and installed (else round-robin over the live workers, `inflight` requests in flight
per worker); a request that fails is retried with exponential backoff (`retries`, `backoff`); a worker that keeps
failing is restarted from the last disk export when we launched it (at most `max_restarts` times, then dropped
with a log line), and its prompts are re-sent to the others.

Timeouts: a non-streamed /generate answers only when all its samples are done, so its timeout grows with what it
asks for (`generate_timeout`: timeout + max_new_tokens / tokens_per_s, the slowest decode a healthy engine keeps
per sequence, queueing included); one that still runs out is sent again, and counts against its worker only when
the worker no longer answers /health. Weight updates are sent once, with `update_timeout` (a disk load of a large
model takes minutes; a second request would queue behind the first): never re-sent on a timeout. A disk update
without an answer in time is not a failure yet: /model_info's `weight_version` is polled for up to another
`update_timeout` until the engine reports the update's version (`load_from_disk`; SGLang 0.5.23 has no
/get_weight_version).

Weight-update sessions: SGLang 0.5.23 takes tensor and distributed updates only between POST /begin_weight_update
and /end_weight_update (`end` runs the model's process_weights_after_loading once, after every bucket). `update`
opens one on every target for the transports that need it (a `begin` refused because a crashed update left one
open: `end`, then `begin` again), and closes it whatever happens; an SGLang without sessions (404) takes updates
outside one. A disk update refused because a session is open (one a crashed update left: `serve` loads from disk
outside sessions only) ends that session and loads again, once. A timed-out /generate is not cancelled on the
engine (requests carry no id): its re-sent copy runs beside it.

Each prompt's result is recorded once, so none is lost or scored twice; an aborted request (finish_reason
"abort", or a weight-version change) is sent again. A restarted worker holding an older weight version, or one
whose restart finished while an update ran (it loaded an export older than that update), waits in `stale` and
rejoins at the next update. A restart that fails for a reason other than the engine's start-up (a full disk under
its log, a failed fork) drops the worker.

Every call here is blocking HTTP (urllib) from a thread pool; the pool itself moves no tensors: weights travel by
`transports.py`, and the `/generate` body and response are `wire.py`'s.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path

from ..base import RolloutSample, SamplingParams, sample_seeds
from .health import is_healthy
from .launcher import EngineProcess, LaunchSpec, Router, router_available
from .wire import AbortedRequest, generate_request

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker failed (unreachable, 5xx, timed out) or refused a weight update: retry elsewhere, restart or drop it.
    urls: the workers known to have failed, when known."""

    def __init__(self, message: str, urls=()):
        super().__init__(message)
        self.urls = tuple(urls)


class TimedOut(WorkerError):
    """No answer within the request's timeout (the worker may still be working on it)."""


class UpdateAborted(RuntimeError):
    """A distributed update's process group was aborted mid-broadcast: `refused`, the engines that refused the
    bucket before taking part; `stuck`, the other members, which wait in the broadcast until their own timeout and
    cannot be sent anything. The pool takes them all out of service."""

    def __init__(self, message: str, stuck=(), refused=()):
        super().__init__(message)
        self.stuck, self.refused = tuple(stuck), tuple(refused)


class Rejected(ValueError):
    """HTTP 4xx: the worker refused the request (SGLang answers a failed weight update with 400)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def request(url: str, path: str, body: dict | None, timeout: float):
    """One JSON request (GET when body is None, else POST) and its decoded answer (`decoded`): Rejected on 4xx,
    WorkerError on 5xx or no answer within `timeout` seconds."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return decoded(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        if 400 <= e.code < 500:  # the request is wrong, or (a weight update) it failed on this worker
            raise Rejected(f"{url}{path}: HTTP {e.code}: {detail}", e.code) from None
        raise WorkerError(f"{url}{path}: HTTP {e.code}: {detail}", (url,)) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            raise TimedOut(f"{url}{path}: no answer within {timeout:.0f} s", (url,)) from None
        raise WorkerError(f"{url}{path}: {e}", (url,)) from None
    except http.client.HTTPException as e:  # the answer cut short (IncompleteRead): the worker died while sending it
        raise WorkerError(f"{url}{path}: the answer was cut short ({e!r})", (url,)) from None


def decoded(raw: bytes):
    """An answer's body: JSON decoded; SGLang's empty ones (/health) None, its text ones (/flush_cache) the text."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def post(url: str, path: str, body: dict, timeout: float):
    """POST `body` once (no retries)."""
    return request(url, path, body, timeout)


def get_info(url: str, name: str, timeout: float) -> dict:
    """GET /<name> (SGLang >= 0.5.2x), else the deprecated /get_<name> of older SGLang."""
    try:
        return request(url, f"/{name}", None, timeout)
    except Rejected as e:
        if e.code != 404:
            raise
        return request(url, f"/get_{name}", None, timeout)


def says_session_open(message: str) -> bool:
    """Whether a refusal says that a weight-update session is open (`serve`: "a weight-update session is open";
    a `begin`: "already open", "in progress"), not that none is ("no weight-update session is open")."""
    text = message.lower()
    return bool(re.search(r"session (?:is )?(?:already )?(?:open|active|in progress)", text)) \
        and not re.search(r"\bno (?:[\w-]+ )*session", text)


# parse(one /generate output row, prompt index) -> the sample; raises ValueError (malformed) or AbortedRequest
Parse = Callable[[dict, int], RolloutSample]
# sent once, with the update timeout: a weight update is never queued twice on a worker
UPDATE_PATHS = frozenset({"/update_weights_from_disk", "/update_weights_from_tensor",
                          "/update_weights_from_distributed", "/init_weights_update_group", "/begin_weight_update",
                          "/end_weight_update"})
DISK_UPDATE = "/update_weights_from_disk"


class WorkerPool:
    """The workers at `urls`, or (urls empty) the `launch.num_engines` that it starts at `launch_all`. State
    (`alive`, `stale`, restarts in progress) is guarded by one lock: restarts run on background threads."""

    def __init__(self, urls, *, launch: LaunchSpec | None, router: bool, timeout: float, retries: int,
                 backoff: float, max_restarts: int, inflight: int, update_timeout: float | None = None,
                 tokens_per_s: float = 5.0, on_failed: Callable[[str], None] = lambda url: None):
        self.launch, self.want_router = launch, router
        self.timeout, self.retries, self.backoff, self.max_restarts = timeout, retries, backoff, max_restarts
        self.update_timeout = update_timeout or timeout
        self.tokens_per_s = tokens_per_s
        self.inflight = inflight
        self.on_failed = on_failed  # called under the lock with each worker taken out of service
        self.procs: dict[str, EngineProcess] = {}
        if launch:
            self.procs = {p.url: p for p in (EngineProcess(launch, i) for i in range(launch.num_engines))}
        self.urls = [u.rstrip("/") for u in urls] or list(self.procs)
        self.alive = [] if launch else list(self.urls)
        self.stale: list[str] = []  # restarted, holding an older version: rejoin at the next weight update
        self.router: Router | None = None
        self.weight_version = -1
        self.released = False
        self.export: tuple[Path, int] | None = None  # the last disk export and its version: restarts load it
        self._replaced: list[Path] = []  # earlier exports, deleted once no restart may read them (`record_export`)
        self.lock = threading.Lock()
        self.restarts: dict[str, Future] = {}  # url -> its restart (`_restart` removes itself before it ends)
        self._restart_pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)), thread_name_prefix="restart")
        self.closed = False
        self.updating = False  # an `update` runs: a restart finishing now joins `stale`, not `alive` (`_restart`)

    # -- lifecycle ----------------------------------------------------------------------------------------------
    @property
    def needs_launch(self) -> bool:
        """Launched workers not started yet (the first weight update starts them)."""
        return bool(self.procs) and not self.procs[self.urls[0]].starts

    def record_export(self, path: Path, version: int) -> None:
        """The disk export that restarts load from now on. The one it replaces is deleted: every worker holds its
        weights in memory once an update returns (update_weights_from_disk loads before it answers), so only a
        restart reads an export, and restarts read the newest. Disk use stays bounded at this export plus the next
        one being written (one full model a step otherwise). A restart in progress may still read the old one:
        it is then deleted with the next export."""
        with self.lock:
            if self.export is not None and self.export[0] != path:
                self._replaced.append(self.export[0])
            self.export = (path, version)
            if self._pending_restarts():
                return
            replaced, self._replaced = self._replaced, []
        for old in replaced:
            shutil.rmtree(old, ignore_errors=True)

    def launch_all(self, path: Path, version: int) -> None:
        """Start every launched worker from the export at `path` (all at once: SGLang's start-up dominates), wait
        until each is healthy, then start the router when asked for. The caller records the export (`export`)."""
        for p in self.procs.values():
            p.start(str(path), version)
        for url, p in self.procs.items():
            p.wait_ready()
            self.alive.append(url)
        log.info("started %d %s engine(s): %s", len(self.procs), self.launch.server, ", ".join(self.procs))
        if self.want_router:
            self._start_router()

    def _start_router(self) -> None:
        if not router_available():
            log.warning("rollout.sglang.router: sglang-router is not installed; round-robin over %d engine(s) instead",
                        len(self.alive))
            return
        try:
            self.router = Router(self.alive, log_dir=self.launch.log_dir)
        except (TimeoutError, RuntimeError, OSError, KeyError, ValueError) as e:  # OSError: URLError too
            log.warning("rollout.sglang.router: sglang-router did not start (%s); round-robin over the engines "
                        "instead", e)
            return
        log.info("sglang-router at %s in front of %d engine(s)", self.router.url, len(self.alive))

    def stop_restarts(self) -> None:
        """No restart starts a worker after this (one in progress is cancelled or stops what it started)."""
        with self.lock:
            self.closed = True
        self._restart_pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop restarts, the router and every launched worker."""
        self.stop_restarts()
        if self.router is not None:
            self.router.close()
        for p in self.procs.values():
            p.stop()

    def health(self) -> bool:
        """GET /health on every live worker (one request each); a failing one is taken out of service."""
        for url in list(self.alive):
            if not is_healthy(url, self.timeout):
                self.failed(url, "health check failed")
        return bool(self.alive)

    # -- faults -------------------------------------------------------------------------------------------------
    def failed(self, url: str, why: str, *, may_restart: bool = True) -> None:
        """Take `url` out of service; restart it in the background when we launched it, may restart it again and
        `may_restart` (False: a restart that failed for a reason a new start would meet again)."""
        if self.closed:
            return
        with self.lock:
            self.on_failed(url)
            if url in self.alive:
                self.alive.remove(url)
            if url in self.stale:
                self.stale.remove(url)
            self._pending_restarts()
            if url in self.restarts:
                return
            proc = self.procs.get(url)
            restart = may_restart and proc is not None and proc.starts <= self.max_restarts and self.export is not None
            if restart:
                self.restarts[url] = self._restart_pool.submit(self._restart, url)
        if self.router is not None:
            self.router.remove(url)
        if restart:
            log.warning("SGLang worker %s failed (%s): restarting it (restart %d of %d)", url, why, proc.starts,
                        self.max_restarts)
        else:
            log.warning("dropping SGLang worker %s: %s%s", url, why,
                        "" if not may_restart else " (no restarts left)" if proc is not None
                        else " (not launched by us: cannot restart)")

    def _restart(self, url: str) -> None:
        """Start `url` again from the last export and put it in service: `alive` when it holds the current version
        and no update runs (an update's `send` does not reach it, and the update may be loading a newer version
        right now), else `stale`, until the next update. It removes itself from `restarts` whatever happens: a
        finished restart left there would hold `settle` and `failed` forever. A start-up that fails (no health in
        time, the process died) counts as a failure, restarted again while restarts are left; anything else (an
        OSError writing the engine log on a full disk, a failed fork) would fail the same way again: dropped."""
        path, version = self.export
        proc = self.procs[url]
        try:
            with self.lock:
                if self.closed:
                    self.restarts.pop(url, None)
                    return
                proc.start(str(path), version)  # under the lock: close() then stops what was started
            proc.wait_ready()
        except Exception as e:
            try:
                proc.stop()
            finally:
                with self.lock:
                    self.restarts.pop(url, None)
            startup = isinstance(e, (TimeoutError, RuntimeError))
            self.failed(url, f"restart failed: {e}" if startup else f"restart failed ({type(e).__name__}: {e})",
                        may_restart=startup)
            return
        with self.lock:
            self.restarts.pop(url, None)
            current = version == self.weight_version and not self.released and not self.updating
            (self.alive if current else self.stale).append(url)
        if current and self.router is not None:
            self.router.add(url)
        log.warning("SGLang worker %s restarted with weight version %d%s", url, version,
                    "" if current else f" (rejoins at the next weight update; the trainer is at {self.weight_version}"
                                       f"{', an update is running' if self.updating else ''})")

    def _pending_restarts(self) -> list[Future]:
        """The restarts still running (call under the lock). A finished one still in `restarts` (cancelled by
        `stop_restarts` before it ran) is removed: waiting on it would return at once, forever."""
        for url in [u for u, f in self.restarts.items() if f.done()]:
            self.restarts.pop(url)
        return list(self.restarts.values())

    def settle(self) -> None:
        """Wait for the restarts in progress."""
        while True:
            with self.lock:
                pending = self._pending_restarts()
            if not pending:
                return
            wait(pending)

    def check_launched(self) -> None:
        """Restart every launched worker that has exited (behind a router a failure does not name the worker, and
        the router retries elsewhere, so this is how we notice)."""
        for url, proc in self.procs.items():
            if url in self.alive and not proc.running():
                self.failed(url, "process exited")

    # -- requests -----------------------------------------------------------------------------------------------
    def generate_timeout(self, params: SamplingParams) -> float:
        """How long a /generate of `params` may take on a healthy worker: timeout + max_new_tokens / tokens_per_s."""
        return self.timeout + params.max_new_tokens / self.tokens_per_s

    def call(self, url, path, body, timeout: float | None = None):
        """POST with retries and exponential backoff; WorkerError when the worker keeps failing. A weight update
        (UPDATE_PATHS) is sent once, with the update timeout; a timeout (TimedOut) is never retried here: the
        worker may still be working on the request."""
        if path == DISK_UPDATE:
            return self.load_from_disk(url, body)
        if path in UPDATE_PATHS:
            return post(url, path, body, self.update_timeout)
        for attempt in range(self.retries + 1):
            try:
                return post(url, path, body, timeout or self.timeout)
            except TimedOut:
                raise
            except WorkerError:
                if attempt == self.retries:
                    raise
                time.sleep(self.backoff * 2**attempt)

    def load_from_disk(self, url: str, body: dict):
        """/update_weights_from_disk, sent once with the update timeout. Refused because a weight-update session is
        open (a crashed update left it): that session is ended (only then: an `end` is never sent blindly) and the
        load sent once more. No answer within the update timeout: the engine may still be loading, and a second
        request would queue behind the first, so /model_info is polled instead, for up to another update timeout,
        until it reports the update's version (then the load succeeded); else TimedOut."""
        try:
            try:
                return post(url, DISK_UPDATE, body, self.update_timeout)
            except Rejected as e:
                if not says_session_open(str(e)):
                    raise
                log.warning("%s refused a disk update inside a weight-update session left open (%s): ending that "
                            "session and loading again", url, e)
                self._end_leftover_session(url)
                return post(url, DISK_UPDATE, body, self.update_timeout)
        except TimedOut as e:
            return self._await_version(url, body.get("weight_version"), e)

    def _await_version(self, url: str, version, timed_out: TimedOut) -> dict:
        """Poll /model_info's `weight_version` (SGLang 0.5.23 moves it with every update and has no
        /get_weight_version; /server_info keeps the launch's) every update_timeout / 10, at most 1 s, until it
        reports `version`, for up to update_timeout; the answer a successful update would have given, else
        `timed_out`, extended. An engine without the route (4xx) or the field has nothing to wait on: `timed_out`."""
        if version is None:
            raise timed_out
        log.warning("%s: polling /model_info for up to %.0f s until it reports weight version %s (the engine may "
                    "still be loading)", timed_out, self.update_timeout, version)
        deadline, every = time.monotonic() + self.update_timeout, min(1.0, self.update_timeout / 10)
        while True:
            left = deadline - time.monotonic()
            try:
                out = get_info(url, "model_info", max(min(self.timeout, left), every))
            except Rejected:  # no such route: nothing to wait on
                raise timed_out from None
            except WorkerError:  # busy loading, or gone: asked again until the deadline
                out = None
            if out is not None:
                reported = out.get("weight_version") if isinstance(out, dict) else None
                if reported is None:  # an engine that does not say its version
                    raise timed_out
                if str(reported) == str(version):
                    log.warning("%s took the update to version %s after its timeout", url, version)
                    return {"success": True, "message": f"weight version {version} reported by /model_info after "
                                                        "the update timed out"}
            if time.monotonic() + every > deadline:
                raise TimedOut(f"{timed_out}; /model_info did not report weight version {version} within a further "
                               f"{self.update_timeout:.0f} s", (url,))
            time.sleep(every)

    def post_each(self, targets: list[str], path: str, body) -> None:
        """POST `body` (or body() per worker) to every target, one after the other; a worker that fails, refuses
        (HTTP 4xx, which is how SGLang answers a failed weight update) or answers success false leaves `targets`
        and is restarted or dropped, with a log line."""
        for url in list(targets):
            try:
                out = self.call(url, path, body() if callable(body) else body)
                if path in UPDATE_PATHS and isinstance(out, dict) and out.get("success") is False:
                    raise Rejected(f"{url}{path}: {out}", 200)
            except (WorkerError, Rejected) as e:
                targets.remove(url)
                self.failed(url, f"{path} failed ({e})")

    def broadcast(self, path: str) -> None:
        """POST {} to every live worker; RuntimeError when none is left (and none is restarting)."""
        self.post_each(list(self.alive), path, {})
        with self.lock:
            restarting = self._pending_restarts()
        if not self.alive and not restarting:
            raise RuntimeError(f"{path}: no SGLang worker left")

    # -- memory (colocated engines) -----------------------------------------------------------------------------
    def release_memory(self) -> None:
        """Colocated engines: free the weights and KV cache on every worker while the trainer uses the GPUs."""
        self.broadcast("/release_memory_occupation")
        self.released = True

    def resume_memory(self) -> None:
        """Take the memory back (before the next weight update); a no-op unless released."""
        if self.released:
            self.broadcast("/resume_memory_occupation")
            self.released = False

    # -- weight updates -----------------------------------------------------------------------------------------
    def update(self, version: int, send: Callable[[list[str]], object], *, session: bool = False) -> None:
        """Take every worker (live and stale) out of service, pause its generation, open a weight-update session
        when `session` (tensor and distributed updates; one a crashed update left open is closed first),
        `send(targets)` (which leaves in `targets` the workers that took the update; what it returns is kept alive
        until the sessions are closed: buckets an engine may still be copying), close the sessions, then resume
        generation on every worker it paused and put those that took it back in service at `version`. RuntimeError
        when none did. UpdateAborted (a distributed group aborted mid-broadcast) leaves its stuck members alone,
        takes them and the refusing engines out of service (restarted when launched), and fails. A restart that
        finishes meanwhile joins `stale` (`updating`): it loaded an older export and `send` does not reach it; it is
        kept there, beside the workers that took the update, and rejoins at the next update."""
        self.resume_memory()
        with self.lock:
            targets, self.stale = self.alive + self.stale, []
            self.alive, self.updating = [], True
        synced, paused, stuck, aborted, opened, keep = False, list(targets), set(), {}, [], None
        try:
            self.post_each(targets, "/pause_generation", {})
            opened = self._open_sessions(targets, session) if session else []
            keep = send(targets)
            synced = True
        except UpdateAborted as e:  # the refusing engines hold part of the update: out of service too
            stuck = set(e.stuck)
            aborted = dict.fromkeys([*e.stuck, *e.refused], str(e))
            raise
        finally:
            for url in opened:
                if url in stuck:
                    continue
                try:
                    self._session(url, "/end_weight_update")
                except (WorkerError, Rejected) as e:
                    if url in targets:
                        targets.remove(url)
                        self.failed(url, f"/end_weight_update failed ({e})")
            del keep
            live = [u for u in targets if u not in aborted]
            self.post_each(live, "/continue_generation", {})
            for url in set(paused) - set(live) - stuck:  # dropped: out of our service, but not left paused
                try:
                    post(url, "/continue_generation", {}, self.timeout)
                except (WorkerError, Rejected):
                    pass
            with self.lock:
                if synced:
                    self.weight_version = version
                # what restarts put in service meanwhile stays (none while `updating`; a lost worker is a process
                # that holds a GPU and, behind a router, still answers with the old weights)
                self.alive = live + [u for u in self.alive if u not in live]
                self.updating = False
                targets[:] = live
            for url, why in aborted.items():
                self.failed(url, why)
        if self.router is not None:
            for url in targets:
                self.router.add(url)
        if not targets:
            raise RuntimeError("update_weights: no SGLang worker left")

    def _session(self, url: str, path: str) -> bool:
        """POST /begin_weight_update or /end_weight_update; False when the worker has no such route (an SGLang
        before weight-update sessions, which takes updates outside one)."""
        try:
            out = post(url, path, {}, self.update_timeout)
        except Rejected as e:
            if e.code == 404:
                return False
            raise
        if isinstance(out, dict) and out.get("success") is False:
            raise Rejected(f"{url}{path}: {out}", 200)
        return True

    def _end_leftover_session(self, url: str) -> None:
        """End a session a crashed update left open. Its refusal is not the worker's fault: the crash may have left
        it half a weight (`serve` answers 400 for an FP8 weight whose scale never came, and closes the session all
        the same); the next begin or load says whether the worker takes updates."""
        try:
            self._session(url, "/end_weight_update")
        except Rejected as e:
            log.warning("%s: ending the weight-update session a crashed update left open was refused (%s); going on",
                        url, e)

    def _open_sessions(self, targets: list[str], session: bool) -> list[str]:
        """Begin a session on every target; one refused (a session a crashed update left open) is ended, then
        begun again (an `end` is never sent without a reason: some SGLang builds assert that a session is open).
        The targets where one is open; a target that cannot open one leaves."""
        opened = []
        for url in list(targets):
            try:
                try:
                    began = self._session(url, "/begin_weight_update")
                except Rejected:
                    self._end_leftover_session(url)
                    began = self._session(url, "/begin_weight_update")
                if began:
                    opened.append(url)
            except (WorkerError, Rejected) as e:
                targets.remove(url)
                self.failed(url, f"/begin_weight_update failed ({e})")
        return opened

    # -- generation ---------------------------------------------------------------------------------------------
    def targets(self, direct: bool = False) -> dict[str, int]:
        """Where requests go now, and how many may be in flight at each; `direct`: to the engines even behind a
        router (sglang-router 0.3.2's typed request drops `return_routed_experts`)."""
        if self.router is not None and not self.router.running():
            log.warning("sglang-router at %s died: round-robin over the engines instead", self.router.url)
            self.router.close()
            self.router = None
        with self.lock:
            alive = list(self.alive)
        if self.router is not None and alive and not direct:
            return {self.router.url: self.inflight * len(alive)}
        return {url: self.inflight for url in alive}

    def jobs(self, num_prompts: int, n: int, direct: bool = False) -> list[tuple[int, tuple[int, ...]]]:
        """(prompt, its samples) per request: one request per prompt, or per sample behind sglang-router, which
        takes one sampling_params dict per request (and so one seed)."""
        if self.router is not None and n > 1 and not direct:
            return [(i, (j,)) for i in range(num_prompts) for j in range(n)]
        return [(i, tuple(range(n))) for i in range(num_prompts)]

    def generate(self, prompts: list[list[int]], params: SamplingParams, parse: Parse, *,
                 seeds: list[list[int]] | None = None, budgets: list[int] | None = None,
                 bodies: list[dict] | None = None) -> list[RolloutSample]:
        """params.n samples per prompt, prompt by prompt: every request in flight at once up to the targets'
        capacity, each failed or aborted one sent again (at most (retries + 1) x (workers + restarts) times).
        seeds[i]: prompt i's n sampling seeds (default `sample_seeds`); budgets[i]: its max_new_tokens (default
        params.max_new_tokens), as an extension of partial samples sends. Raises at once (RuntimeError once the pool
        is closed, within a second): the requests still in flight are abandoned, not waited for (each may take up
        to `generate_timeout`; their threads end with their requests)."""
        # routed experts and scoring requests (`bodies`: prompt i's whole request, as `SGLangEngine.score` sends):
        # past the router (`targets`), whose typed request is not known to carry every field they need
        n, direct = params.n, params.return_routed_experts or bodies is not None
        results: dict[int, dict[int, RolloutSample]] = {i: {} for i in range(len(prompts))}
        failures: dict[tuple, int] = {}
        timeouts: dict[tuple, int] = {}
        queue = deque(self.jobs(len(prompts), n, direct))
        max_failures = (self.retries + 1) * (len(self.urls) + self.max_restarts * len(self.procs))
        pool = ThreadPoolExecutor(max_workers=self.inflight * len(self.urls), thread_name_prefix="generate")
        try:
            running = {}
            while queue or running:
                if self.closed:
                    raise RuntimeError(f"generate: the rollout engine was closed; {len(queue) + len(running)} "
                                       "requests unanswered")
                self.check_launched()
                targets = self.targets(direct)
                if not targets and not running:
                    with self.lock:
                        restarting = self._pending_restarts()
                    if not restarting:
                        raise RuntimeError(f"generate: every SGLang worker failed; {len(queue)} requests unanswered")
                    wait(restarting, timeout=1.0)
                    continue
                self._submit(pool, running, queue, targets, prompts, params, seeds, budgets, bodies)
                if not running:
                    continue
                done, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
                for fut in done:
                    url, job = running.pop(fut)
                    i, rows = job
                    try:
                        outs = fut.result()
                        if all(j in results[i] for j in rows):  # one request per job in flight; never scored twice
                            continue
                        outs = outs if isinstance(outs, list) else [outs]
                        if len(outs) != len(rows):
                            raise ValueError(f"generate output for prompt {i}: expected {len(rows)} samples, got "
                                             f"{len(outs)}")
                        samples = [parse(o, i) for o in outs]
                    except TimedOut as e:  # slower than its timeout: the worker is failed only if it stopped answering
                        timeouts[job] = timeouts.get(job, 0) + 1
                        if timeouts[job] > self.retries:
                            raise RuntimeError(f"generate: prompt {i} timed out {timeouts[job]} times ({e}); raise "
                                               "rollout.sglang.timeout_s or lower rollout.sglang.tokens_per_s") \
                                from None
                        if url in self.alive and not is_healthy(url, min(self.timeout, 10.0)):
                            self.failed(url, str(e))
                        log.warning("re-sending prompt %d%s (%s; the worker %s)", i,
                                    "" if len(rows) == n else f" sample {rows[0]}", e,
                                    "answers /health" if url in self.alive else "is out of service")
                        queue.appendleft(job)
                        continue
                    except (WorkerError, AbortedRequest) as e:  # never scored: the job is sampled again
                        failures[job] = failures.get(job, 0) + 1
                        if failures[job] > max_failures:
                            raise RuntimeError(f"generate: prompt {i} failed {failures[job]} times; last: {e}") \
                                from None
                        if isinstance(e, WorkerError) and url in self.alive:  # behind a router, check_launched
                            self.failed(url, str(e))                          # finds the dead one
                        log.warning("re-sending prompt %d%s (%s)", i, "" if len(rows) == n else f" sample {rows[0]}",
                                    e)
                        queue.appendleft(job)
                        continue
                    results[i].update(zip(rows, samples, strict=True))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # a `with` would wait for every request still in flight
            raise
        pool.shutdown()
        return [results[i][j] for i in range(len(prompts)) for j in range(n)]

    def _submit(self, pool, running: dict, queue: deque, targets: dict[str, int], prompts, params, seeds,
                budgets, bodies=None) -> None:
        """Fill every target up to its capacity from the front of `queue`."""
        load = {url: 0 for url in targets}
        for url, _ in running.values():
            load[url] = load.get(url, 0) + 1
        for url, cap in targets.items():
            while queue and load[url] < cap:
                job = queue.popleft()
                i = job[0]
                body = bodies[i] if bodies is not None else generate_request(
                    prompts[i], params if budgets is None else replace(
                    params, max_new_tokens=budgets[i]), sample_seeds(params, i) if seeds is None else seeds[i], job[1])
                running[pool.submit(self.call, url, "/generate", body, self.generate_timeout(params))] = (url, job)
                load[url] += 1
