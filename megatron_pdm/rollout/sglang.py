"""`SGLangEngine`: a `RolloutEngine` over SGLang HTTP workers (or `megatron-pdm serve`, which speaks the same API).

The engine either attaches to running workers (`urls`, e.g. started by the Slurm script) or launches them itself
(`launch`) from the first weights it is given. Prompts go to sglang-router when asked for and installed (else
round-robin over the live workers, several requests in flight per worker), one request per prompt carrying its
n samples. A request that times out or fails is retried with exponential backoff; a worker that keeps failing
is restarted when we launched it (at most max_restarts times, then dropped with a log line), and its prompts are
re-sent to the others. Each prompt's result is recorded once, so none is lost or scored twice. A request that
an engine aborted (finish_reason "abort", which `/pause_generation` gives the requests in flight) or that spans
two weight versions is sent again, never scored. Responses are validated (ids in range, finite log-probs, K as
asked) and must carry the weight version the trainer pushed last, so that a rollout is never scored against the
wrong weights. Each of the n samples of a prompt has its own `sampling_seed` (SGLang honours seeds only with
--enable-deterministic-inference, and then n copies with one seed would be n equal samples).

Weight sync (`weight_sync`): "disk" writes an HF export and calls /update_weights_from_disk (works everywhere);
"distributed" broadcasts bucketed tensors over a process group of the trainer and every engine rank
(/init_weights_update_group + /update_weights_from_distributed; NCCL on GPUs, gloo on a CPU), for engines on
other nodes; "tensor" hands colocated engines the tensors themselves (/update_weights_from_tensor). Generation
is paused around every update; an engine whose update fails (SGLang answers HTTP 400 with success false) is
restarted when we launched it, else dropped, with a log line, and generation resumes on the others. An engine
restarted between updates loads the last disk export and rejoins when it holds the current version (at once
under "disk", at the next update otherwise). `update_weights` takes a full state dict or a stream of buckets (the
trainer's `train.weight_sync.sync_weights`), consumed one at a time: disk writes one safetensors shard per bucket
and the index, distributed and tensor send each bucket as it comes (a failed engine is dropped and the bucket sent
again to a new group of the rest) and, not knowing which bucket is last, commit the version with each one (the
engines are paused throughout). The wire format is `wire.py`, shared with `server.py`.

Weights travel in the engine's dtype (`dtype`, the rollout dtype), or block-FP8 (float8_e4m3fn + `_scale_inv`
per 128 x 128 block) to FP8 engines: those we launch when `quantization` is "fp8" (they start from a block-FP8
export), and attached ones that say so (`/server_info`, and the `quantization_config` of their checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from . import weight_transfer
from .base import RolloutSample, SamplingParams, Weights, weight_buckets
from .fp8_export import is_block_fp8
from .health import is_healthy, wait_healthy
from .launcher import EngineProcess, LaunchSpec, Router, free_port, router_available
from .wire import AbortedRequest, generate_request, parse_generate_output

__all__ = ["AbortedRequest", "SGLangEngine", "WorkerError", "parse_generate_output"]

WEIGHT_SYNCS = ("disk", "distributed", "tensor")
QUANTIZATIONS = (None, "fp8")

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker failed (unreachable, 5xx, timed out) or refused a weight update: retry elsewhere, restart or drop it.
    urls: the workers known to have failed, when known."""

    def __init__(self, message: str, urls=()):
        super().__init__(message)
        self.urls = tuple(urls)


class Rejected(ValueError):
    """HTTP 4xx: the worker refused the request (SGLang answers a failed weight update with 400)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _request(url: str, path: str, body: dict | None, timeout: float):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        if 400 <= e.code < 500:  # the request is wrong, or (a weight update) it failed on this worker
            raise Rejected(f"{url}{path}: HTTP {e.code}: {detail}", e.code) from None
        raise WorkerError(f"{url}{path}: HTTP {e.code}: {detail}", (url,)) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        raise WorkerError(f"{url}{path}: {e}", (url,)) from None


def _post(url: str, path: str, body: dict, timeout: float):
    return _request(url, path, body, timeout)


def _get_info(url: str, name: str, timeout: float) -> dict:
    """GET /<name> (SGLang >= 0.5.2x), else the deprecated /get_<name> of older SGLang."""
    try:
        return _request(url, f"/{name}", None, timeout)
    except Rejected as e:
        if e.code != 404:
            raise
        return _request(url, f"/get_{name}", None, timeout)


def engine_quantization(url: str, flag: str | None, model_path, config: dict | None) -> str | None:
    """What weights the SGLang engine at `url` takes: "fp8" (block-FP8) or None (its dtype), from its --quantization
    flag (/server_info `quantization`) and its checkpoint's config.json (`config`, None when the trainer cannot
    read it: SGLang serves a block-FP8 checkpoint as FP8 without the flag). ValueError when it cannot be known or
    takes no weight updates."""
    where = f"rollout.urls: {url} (model {model_path!r}, --quantization {flag})"
    if config is None:
        raise ValueError(f"{where}: cannot tell whether the engine is quantized: its checkpoint's config.json is not "
                         "readable from the trainer (SGLang serves a block-FP8 checkpoint as FP8 without "
                         "--quantization); give the engines a model path the trainer can read")
    quant = config.get("quantization_config")
    if is_block_fp8(quant):
        return "fp8"
    if quant:
        raise ValueError(f"{where}: checkpoint quantization_config {quant} is not block-FP8 [128, 128], the only "
                         "quantized weights the trainer sends")
    if flag == "fp8":
        raise ValueError(f"{where}: the engine quantizes a bf16 checkpoint to FP8 itself, and SGLang refuses weight "
                         "updates into such an engine; start it from a block-FP8 checkpoint without --quantization "
                         "(python -m megatron_pdm.rollout.fp8_export SRC DST)")
    if flag:
        raise ValueError(f"{where}: quantization {flag!r} is not supported (none, or block-FP8 checkpoints)")
    return None


class SGLangEngine:
    """`RolloutEngine` over SGLang workers serving `model_config`'s model: those at `urls`, or (urls empty)
    `launch.num_engines` that it starts itself. Disk exports go under `weight_dir` (every worker reads it)."""

    def __init__(self, urls: list[str] | tuple[str, ...], model_config, *, weight_dir,
                 launch: LaunchSpec | None = None, router: bool = False, weight_sync: str = "disk",
                 timeout: float = 60.0, retries: int = 2, backoff: float = 0.5, max_restarts: int = 2,
                 inflight_per_engine: int = 16, engine_tp: int = 1, bucket_bytes: int = 512 << 20,
                 sync_backend: str | None = None, master_address: str | None = None,
                 quantization: str | None = None, dtype: str | None = None, tokenizer_dir=None):
        if bool(urls) == (launch is not None):
            raise ValueError("rollout.urls / rollout.num_engines: give worker URLs to attach to or engines to "
                             "launch, not both and not neither")
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"rollout.weight_sync: {weight_sync!r} is not one of {', '.join(WEIGHT_SYNCS)}")
        self.model_config, self.vocab_size = model_config, model_config.vocab_size
        self.weight_dir = Path(weight_dir)
        self.launch, self.want_router, self.weight_sync = launch, router, weight_sync
        self.timeout, self.retries, self.backoff, self.max_restarts = timeout, retries, backoff, max_restarts
        self.inflight, self.bucket_bytes = inflight_per_engine, bucket_bytes
        self.master_address = master_address  # None: weight_transfer.trainer_address picks it
        self.engine_tp = launch.tp if launch else engine_tp
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"rollout quantization: {quantization!r} is not one of {QUANTIZATIONS}")
        if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"rollout dtype: {dtype!r} is not float32, bfloat16 or float16")
        self.quantization, self.dtype = quantization, dtype
        # block-FP8 weights (q + _scale_inv) by every transport: launched FP8 engines start from a block-FP8 export;
        # attached engines are asked (wait_ready)
        self.fp8: bool | None = quantization == "fp8" if launch else None
        if quantization == "fp8":
            from megatron_pdm.precision import check_fp8_block_shapes

            check_fp8_block_shapes(model_config, self.engine_tp)
        self.tokenizer_dir = tokenizer_dir  # copied into every disk export: engines start with the same tokenizer
        self.sync_backend = sync_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.procs: dict[str, EngineProcess] = {}
        if launch:
            self.procs = {p.url: p for p in (EngineProcess(launch, i) for i in range(launch.num_engines))}
        self.urls = [u.rstrip("/") for u in urls] or list(self.procs)
        self.alive = [] if launch else list(self.urls)
        self.stale: list[str] = []  # restarted, holding an older version: rejoin at the next weight update
        self.router: Router | None = None
        self.weight_version = -1
        self.released = False
        self.export: tuple[Path, int] | None = None  # the last disk export and its version
        self._lock = threading.Lock()
        self._restarts: dict[str, object] = {}
        self._restart_pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)), thread_name_prefix="restart")
        self._group, self._group_members, self._group_valid, self._groups_made = None, (), False, 0
        self._warned_truncation = False
        self._closed = False

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self, deadline_s: float = 120.0) -> None:
        """The protocol's start: `wait_ready`."""
        self.wait_ready(deadline_s)

    def wait_ready(self, deadline_s: float = 120.0) -> None:
        """Attached workers: wait until every one is healthy and learn what weights they take (launched ones are
        started by the first update)."""
        if not self.launch:
            wait_healthy(self.urls, deadline_s=deadline_s, poll_s=0.2)
            self._probe_quantization()

    def _probe_quantization(self) -> None:
        """Ask every attached engine whether it is FP8 (block-FP8 weights) or not; they must agree with each other
        and with `quantization` (precision.rollout)."""
        found = {}
        for url in self.urls:
            info = _get_info(url, "server_info", self.timeout)
            path = info.get("model_path") or _get_info(url, "model_info", self.timeout).get("model_path")
            try:
                config = json.loads((Path(str(path)) / "config.json").read_text())
            except (OSError, ValueError):
                config = None
            found[url] = engine_quantization(url, info.get("quantization"), path, config)
        for url, q in found.items():
            if q != self.quantization:
                raise ValueError(f"precision.rollout: the config asks for {self.quantization or 'unquantized'} "
                                 f"rollout engines, but the engine at {url} is {q or 'unquantized'} "
                                 f"({', '.join(f'{u}: {v}' for u, v in found.items())})")
        self.fp8 = self.quantization == "fp8"

    def _start(self, weights, version: int) -> None:
        path = self._export(weights, version)
        for p in self.procs.values():  # all start at once: SGLang's start-up dominates
            p.start(str(path), version)
        for url, p in self.procs.items():
            p.wait_ready()
            self.alive.append(url)
        log.info("started %d %s engine(s): %s", len(self.procs), self.launch.server, ", ".join(self.procs))
        if self.want_router:
            self._start_router()

    def _start_router(self) -> None:
        if not router_available():
            log.warning("rollout.router: sglang-router is not installed; round-robin over %d engine(s) instead",
                        len(self.alive))
            return
        try:
            self.router = Router(self.alive, log_dir=self.launch.log_dir)
        except (TimeoutError, RuntimeError, OSError) as e:
            log.warning("rollout.router: sglang-router did not start (%s); round-robin over the engines instead", e)
            return
        log.info("sglang-router at %s in front of %d engine(s)", self.router.url, len(self.alive))

    def close(self) -> None:
        with self._lock:  # a restart in progress starts nothing after this
            self._closed = True
        self._restart_pool.shutdown(wait=False, cancel_futures=True)
        self._destroy_group()
        if self.router is not None:
            self.router.close()
        for p in self.procs.values():
            p.stop()

    def health(self) -> bool:
        for url in list(self.alive):
            if not is_healthy(url, self.timeout):
                self._failed(url, "health check failed")
        return bool(self.alive)

    # -- faults -------------------------------------------------------------------------------------------------
    def _failed(self, url: str, why: str) -> None:
        """Take `url` out of service; restart it in the background when we launched it and may restart it again."""
        if self._closed:
            return
        with self._lock:
            if url in self._group_members:  # a restarted worker on the same URL is a new member
                self._group_valid = False
            if url in self.alive:
                self.alive.remove(url)
            if url in self.stale:
                self.stale.remove(url)
            if url in self._restarts:
                return
            proc = self.procs.get(url)
            restart = proc is not None and proc.starts <= self.max_restarts and self.export is not None
            if restart:
                self._restarts[url] = self._restart_pool.submit(self._restart, url)
        if self.router is not None:
            self.router.remove(url)
        if restart:
            log.warning("SGLang worker %s failed (%s): restarting it (restart %d of %d)", url, why, proc.starts,
                        self.max_restarts)
        else:
            log.warning("dropping SGLang worker %s: %s%s", url, why,
                        " (no restarts left)" if proc is not None else " (not launched by us: cannot restart)")

    def _restart(self, url: str) -> None:
        path, version = self.export
        proc = self.procs[url]
        try:
            with self._lock:
                if self._closed:
                    return
                proc.start(str(path), version)  # under the lock: close() then stops what was started
            proc.wait_ready()
        except (TimeoutError, RuntimeError) as e:
            proc.stop()
            with self._lock:
                self._restarts.pop(url)
            self._failed(url, f"restart failed: {e}")
            return
        with self._lock:
            self._restarts.pop(url)
            current = version == self.weight_version and not self.released
            (self.alive if current else self.stale).append(url)
        if current and self.router is not None:
            self.router.add(url)
        log.warning("SGLang worker %s restarted with weight version %d%s", url, version,
                    "" if current else f" (rejoins at the next weight update; the trainer is at {self.weight_version})")

    def _settle(self) -> None:
        """Wait for the restarts in progress."""
        while True:
            with self._lock:
                pending = list(self._restarts.values())
            if not pending:
                return
            wait(pending)

    def _call(self, url, path, body):
        """POST with retries and exponential backoff; WorkerError when the worker keeps failing."""
        for attempt in range(self.retries + 1):
            try:
                return _post(url, path, body, self.timeout)
            except WorkerError:
                if attempt == self.retries:
                    raise
                time.sleep(self.backoff * 2**attempt)

    # -- weights ------------------------------------------------------------------------------------------------
    def engine_state(self, state: dict) -> dict:
        """The tensors the engines take: block-FP8 pairs (q float8_e4m3fn, `_scale_inv` float32) for the linear
        weights of FP8 engines, quantized from the trainer's values, and everything else in the engine's dtype."""
        import torch

        from megatron_pdm.precision import FP8_SCALE_SUFFIX, fp8_block_state

        if self.fp8 is None:  # attached engines not asked yet
            self._probe_quantization()
        if self.fp8:
            state = fp8_block_state(state)
        if self.dtype is None:
            return state
        dtype = getattr(torch, self.dtype)
        return {n: t if t.dtype == torch.float8_e4m3fn or n.endswith(FP8_SCALE_SUFFIX) else t.to(dtype)
                for n, t in state.items()}

    def _engine_weights(self, weights):
        """`engine_state` of a full dict, or of each bucket of a stream as it comes."""
        if isinstance(weights, Mapping):
            return self.engine_state(weights)
        return (self.engine_state(bucket) for bucket in weights)

    def _export(self, weights, version: int) -> Path:
        """An HF checkpoint of the engine weights (`engine_state`: a full dict, one file; a stream, one shard per
        bucket), with the trainer's tokenizer files."""
        from megatron_pdm.models.hf import save_hf_checkpoint
        from megatron_pdm.precision import FP8_QUANTIZATION_CONFIG

        path = self.weight_dir / f"v{version:06d}"
        extra = {"quantization_config": FP8_QUANTIZATION_CONFIG} if self.fp8 else {}
        save_hf_checkpoint(path, weights, self.model_config, tokenizer_dir=self.tokenizer_dir,
                           extra_config={**extra, **({"torch_dtype": self.dtype} if self.dtype else {})})
        self.export = (path, version)
        return path

    def update_weights(self, weights: Weights, version: int) -> None:
        """Push the HF-layout weights (a full dict, or a stream of buckets taken one at a time) to every engine
        (starting launched ones the first time); rollouts after this carry `version`. Generation is paused on every
        engine meanwhile and resumed on those that remain."""
        self._settle()
        if self.fp8 is None:  # attached engines not asked yet
            self._probe_quantization()
        state = self._engine_weights(weights)
        del weights
        if self.launch and not self.procs[self.urls[0]].starts:
            self._start(state, version)
            self.weight_version = version
            return
        self.resume_memory()
        with self._lock:
            targets, self.stale = self.alive + self.stale, []
            self.alive = []
        synced, paused = False, list(targets)
        try:
            self._post_each(targets, "/pause_generation", {})
            # each leaves in `targets` the workers that took the update
            {"disk": self._sync_disk, "distributed": self._sync_distributed, "tensor": self._sync_tensor}[
                self.weight_sync](state, version, targets)
            synced = True
        finally:
            self._post_each(targets, "/continue_generation", {})
            for url in set(paused) - set(targets):  # dropped: out of our service, but not left paused for others
                try:
                    _post(url, "/continue_generation", {}, self.timeout)
                except (WorkerError, Rejected):
                    pass
            with self._lock:
                if synced:
                    self.weight_version = version
                self.alive = targets
        if self.router is not None:
            for url in targets:
                self.router.add(url)
        if not targets:
            raise RuntimeError("update_weights: no SGLang worker left")

    def _post_each(self, targets: list[str], path: str, body) -> None:
        """POST `body` (or body() per worker) to every target; a worker that fails, refuses (HTTP 4xx, which is how
        SGLang answers a failed weight update) or answers success false leaves `targets` and is restarted or
        dropped, with a log line."""
        for url in list(targets):
            try:
                out = self._call(url, path, body() if callable(body) else body)
                if path.startswith("/update_weights") and not out.get("success"):
                    raise Rejected(f"{url}{path}: {out}", 200)
            except (WorkerError, Rejected) as e:
                targets.remove(url)
                self._failed(url, f"{path} failed ({e})")

    def _sync_disk(self, weights, version, targets):
        path = self._export(weights, version)
        self._post_each(targets, "/update_weights_from_disk",
                        {"model_path": str(path), "weight_version": str(version), "flush_cache": True})

    def _tensors(self, state, names):
        """The tensors as the transport needs them: on the GPU for NCCL, in host memory for gloo."""
        device = None
        if self.weight_sync == "distributed":
            device = "cpu" if self.sync_backend == "gloo" else "cuda"
        return [state[n].detach().to(device or state[n].device).contiguous() for n in names]

    def _sub_buckets(self, weights):
        """(state, names, commit) per transport bucket of at most bucket_bytes: a full dict cut as before, with
        `commit` (the update's weight_version and a cache flush) on its last bucket only; a stream cut bucket by
        bucket, every one committing (the last is not known before the stream ends, and generation is paused
        throughout, so no rollout sees the version before all weights are in)."""
        full = isinstance(weights, Mapping)
        for state in weight_buckets(weights):
            groups = weight_transfer.buckets(state, self.bucket_bytes)
            for j, names in enumerate(groups):
                yield state, names, not full or j == len(groups) - 1
            del state

    def _sync_tensor(self, weights, version, targets):
        for state, names, commit in self._sub_buckets(weights):
            named = weight_transfer.shared(list(zip(names, self._tensors(state, names), strict=True)))
            del state

            def body(named=named, commit=commit):  # one pickle per engine: each is good for one reader
                return {"serialized_named_tensors": [weight_transfer.serialize_named_tensors(named)] * self.engine_tp,
                        "load_format": None, "flush_cache": commit,
                        **({"weight_version": str(version)} if commit else {})}

            self._post_each(targets, "/update_weights_from_tensor", body)
            del named, body
            if not targets:
                return

    def _sync_distributed(self, weights, version, targets):
        """Every bucket: announce (names, dtypes, shapes) to every engine, then broadcast the tensors from rank 0.
        A worker failing mid-way breaks the group: drop it, make a new group of the rest, and send the bucket
        again (loading a bucket twice is harmless; the buckets before it are in every remaining engine)."""
        for state, names, commit in self._sub_buckets(weights):
            tensors = self._tensors(state, names)
            del state
            while targets:  # each failed attempt removes at least one worker
                try:
                    if not self._group_valid or self._group_members != tuple(targets):
                        self._init_group(targets)
                    self._broadcast_bucket(names, tensors, version if commit else None, targets)
                    break
                except WorkerError as e:
                    self._group_valid = False
                    bad = [u for u in e.urls if u in targets] or \
                        [u for u in targets if not is_healthy(u, self.timeout)] or targets[-1:]
                    for url in bad:
                        targets.remove(url)
                        self._failed(url, f"update_weights_from_distributed failed ({e})")
            del tensors
            if not targets:
                return

    @staticmethod
    def _failed_updates(futures: dict) -> list[str]:
        """The workers whose weight-update request failed or answered without success (after the broadcast)."""
        bad = []
        for url, f in futures.items():
            try:
                ok = f.result().get("success")
            except (WorkerError, Rejected):
                ok = False
            if not ok:
                bad.append(url)
        return bad

    def _init_group(self, targets) -> None:
        """A process group of the trainer (rank 0) and every engine rank, built on both sides as SGLang builds it
        (weight_transfer.custom_process_group), at the trainer's reachable address."""
        self._destroy_group()
        self._groups_made += 1
        address = weight_transfer.trainer_address(targets, self.master_address)
        name, port = f"megatron-pdm-{os.getpid()}-{id(self) % 65536:x}-{self._groups_made}", free_port("")
        world = 1 + self.engine_tp * len(targets)
        with ThreadPoolExecutor(max_workers=len(targets)) as pool:
            futs = {url: pool.submit(_post, url, "/init_weights_update_group",
                                     {"master_address": address, "master_port": port,
                                      "rank_offset": 1 + i * self.engine_tp, "world_size": world, "group_name": name,
                                      "backend": self.sync_backend}, self.timeout) for i, url in enumerate(targets)}
            try:
                group = weight_transfer.custom_process_group(address, port, 0, world, name,
                                                             backend=self.sync_backend, timeout_s=self.timeout)
            except RuntimeError as e:  # a worker never joined
                raise WorkerError(f"init_weights_update_group at {address}:{port}: {e}",
                                  self._failed_updates(futs)) from None
            bad = self._failed_updates(futs)
        if bad:
            weight_transfer.destroy_group(group)
            raise WorkerError(f"init_weights_update_group failed on {bad}", bad)
        self._group, self._group_members, self._group_name, self._group_valid = group, tuple(targets), name, True
        log.info("weights group %s: the trainer at %s:%d and %d engine rank(s)", name, address, port, world - 1)

    def _destroy_group(self) -> None:
        if self._group is None:
            return
        for url in self._group_members:
            try:
                _post(url, "/destroy_weights_update_group", {"group_name": self._group_name}, self.timeout)
            except (WorkerError, ValueError):
                pass  # a dead or restarted worker holds no group
        weight_transfer.destroy_group(self._group)
        self._group = None

    def _broadcast_bucket(self, names, tensors, version: int | None, targets) -> None:
        """One /update_weights_from_distributed per engine (the announcement; `version` and a cache flush when it
        commits) and the broadcast of its tensors."""
        body = {"names": names, "dtypes": [weight_transfer.dtype_name(t.dtype) for t in tensors],
                "shapes": [list(t.shape) for t in tensors], "group_name": self._group_name,
                "flush_cache": version is not None, **({} if version is None else {"weight_version": str(version)})}
        with ThreadPoolExecutor(max_workers=len(targets)) as pool:
            futs = {url: pool.submit(_post, url, "/update_weights_from_distributed", body, self.timeout)
                    for url in targets}
            try:
                weight_transfer.broadcast_tensors(self._group, tensors)
            except RuntimeError as e:
                raise WorkerError(f"broadcast: {e}") from None
            bad = self._failed_updates(futs)
        if bad:  # they left the group's collectives: a new group of the others gets the bucket again
            raise WorkerError(f"update_weights_from_distributed failed on {bad}", bad)

    # -- memory (colocated engines) -----------------------------------------------------------------------------
    def release_memory(self) -> None:
        """Colocated engines: free the weights and KV cache on every worker while the trainer uses the GPUs."""
        self._broadcast("/release_memory_occupation")
        self.released = True

    def resume_memory(self) -> None:
        """Take the memory back (before the next weight update); a no-op unless released."""
        if self.released:
            self._broadcast("/resume_memory_occupation")
            self.released = False

    def _broadcast(self, path: str) -> None:
        self._post_each(list(self.alive), path, {})
        if not self.alive and not self._restarts:
            raise RuntimeError(f"{path}: no SGLang worker left")

    # -- generation ---------------------------------------------------------------------------------------------
    @staticmethod
    def sample_seeds(params: SamplingParams, prompt_index: int) -> list[int] | None:
        """The `sampling_seed` of each of the n samples of prompt `prompt_index`: seed * 1_000_003 + i * n + j,
        distinct for every sample of a generate call (None without a seed)."""
        if params.seed is None:
            return None
        base = params.seed * 1_000_003 + prompt_index * params.n
        return [(base + j) % 2**63 for j in range(params.n)]

    def _request(self, prompt: list[int], params: SamplingParams, seeds: list[int] | None,
                 rows: tuple[int, ...] | None = None) -> dict:
        return generate_request(prompt, params, seeds, rows)

    def _targets(self) -> dict[str, int]:
        """Where requests go now, and how many may be in flight at each."""
        if self.router is not None and not self.router.running():
            log.warning("sglang-router at %s died: round-robin over the engines instead", self.router.url)
            self.router.close()
            self.router = None
        with self._lock:
            alive = list(self.alive)
        if self.router is not None and alive:
            return {self.router.url: self.inflight * len(alive)}
        return {url: self.inflight for url in alive}

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RolloutSample]:
        if self.weight_version < 0:
            raise RuntimeError("generate: no weights pushed yet (call update_weights first)")
        if params.truncated and not self._warned_truncation:
            log.warning("rollout with top_p=%s top_k=%s: SGLang returns log-probs of the untruncated distribution, "
                        "which the masks assume, but samples from the truncated one: ratios and masks are biased",
                        params.top_p, params.top_k)
            self._warned_truncation = True
        routed = None
        if params.return_routed_experts:
            m = self.model_config
            if not m.is_moe:
                raise ValueError("sampling.return_routed_experts: the model has no MoE layers")
            routed = (m.num_layers, m.moe_router_topk, m.num_experts)
        # jobs (prompt, its samples): one request per prompt, or per sample behind sglang-router, which takes one
        # sampling_params dict per request (and so one seed)
        n = params.n
        if self.router is not None and n > 1:
            jobs = [(i, (j,)) for i in range(len(prompts)) for j in range(n)]
        else:
            jobs = [(i, tuple(range(n))) for i in range(len(prompts))]
        results: dict[int, dict[int, RolloutSample]] = {i: {} for i in range(len(prompts))}
        failures: dict[tuple, int] = {}
        queue = deque(jobs)
        max_failures = (self.retries + 1) * (len(self.urls) + self.max_restarts * len(self.procs))
        with ThreadPoolExecutor(max_workers=self.inflight * len(self.urls)) as pool:
            running = {}
            while queue or running:
                self._check_launched()
                targets = self._targets()
                if not targets and not running:
                    with self._lock:
                        restarting = list(self._restarts.values())
                    if not restarting:
                        raise RuntimeError(f"generate: every SGLang worker failed; {len(queue)} requests unanswered")
                    wait(restarting, timeout=1.0)
                    continue
                load = {url: 0 for url in targets}
                for url, _ in running.values():
                    load[url] = load.get(url, 0) + 1
                for url, cap in targets.items():
                    while queue and load[url] < cap:
                        job = queue.popleft()
                        request = self._request(prompts[job[0]], params, self.sample_seeds(params, job[0]), job[1])
                        running[pool.submit(self._call, url, "/generate", request)] = (url, job)
                        load[url] += 1
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
                        samples = [parse_generate_output(o, prompt_index=i, prompt_ids=prompts[i],
                                                         k=params.top_k_logprobs, vocab_size=self.vocab_size,
                                                         weight_version=self.weight_version, routed_experts=routed)
                                   for o in outs]
                    except (WorkerError, AbortedRequest) as e:  # never scored: the job is sampled again
                        failures[job] = failures.get(job, 0) + 1
                        if failures[job] > max_failures:
                            raise RuntimeError(f"generate: prompt {i} failed {failures[job]} times; last: {e}") \
                                from None
                        if isinstance(e, WorkerError) and url in self.alive:  # behind a router, _check_launched
                            self._failed(url, str(e))                         # finds the dead one
                        log.warning("re-sending prompt %d%s (%s)", i, "" if len(rows) == n else f" sample {rows[0]}",
                                    e)
                        queue.appendleft(job)
                        continue
                    results[i].update(zip(rows, samples, strict=True))
        return [results[i][j] for i in range(len(prompts)) for j in range(n)]

    def _check_launched(self) -> None:
        """Restart every launched worker that has exited (behind a router a failure does not name the worker, and
        the router retries elsewhere, so this is how we notice)."""
        for url, proc in self.procs.items():
            if url in self.alive and not proc.running():
                self._failed(url, "process exited")
