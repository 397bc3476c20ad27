"""`SGLangEngine`: a `RolloutEngine` over SGLang HTTP workers (or `megatron-pdm serve`, which speaks the same API).

The engine either attaches to running workers (`urls`, e.g. started by the Slurm script) or launches them itself
(`launch`) from the first weights it is given. Prompts go to sglang-router when asked for and installed (else
round-robin over the live workers, several requests in flight per worker), one request per prompt carrying its
n samples. A request that times out or fails is retried with exponential backoff; a worker that keeps failing
is restarted when we launched it (at most max_restarts times, then dropped with a log line), and its prompts are
re-sent to the others. Each prompt's result is recorded once, so none is lost or scored twice. Responses are
validated (ids in range, finite log-probs, K as asked) and must carry the weight version the trainer pushed
last, so that a rollout is never scored against the wrong weights.

Weight sync (`weight_sync`): "disk" writes an HF export and calls /update_weights_from_disk (works everywhere);
"distributed" broadcasts bucketed tensors over a process group of the trainer and every engine rank
(/init_weights_update_group + /update_weights_from_distributed; NCCL on GPUs, gloo on a CPU), for engines on
other nodes; "tensor" hands colocated engines the tensors themselves (/update_weights_from_tensor). Generation
is paused around every update. An engine restarted between updates loads the last disk export and rejoins when
it holds the current version (at once under "disk", at the next update otherwise).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from . import weight_transfer
from .base import RolloutSample, SamplingParams
from .health import is_healthy, wait_healthy
from .launcher import EngineProcess, LaunchSpec, Router, free_port, router_available

WEIGHT_SYNCS = ("disk", "distributed", "tensor")

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    pass


def _post(url: str, path: str, body: dict, timeout: float):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        if 400 <= e.code < 500:  # the request is wrong: retrying elsewhere will not help
            raise ValueError(f"{url}{path}: HTTP {e.code}: {detail}") from None
        raise WorkerError(f"{url}{path}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        raise WorkerError(f"{url}{path}: {e}") from None


def parse_generate_output(out: dict, *, prompt_index: int, prompt_ids: list[int], k: int, vocab_size: int,
                          weight_version: int, routed_experts: tuple[int, int, int] | None = None) -> RolloutSample:
    """One SGLang `/generate` output -> RolloutSample; ValueError naming the field when malformed.
    routed_experts (layers, top_k, num_experts): parse meta_info.routed_experts too."""
    where = f"generate output for prompt {prompt_index}"
    if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
        raise ValueError(f"{where}: meta_info: missing")
    meta = out["meta_info"]
    tok, top = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
    if not isinstance(tok, list):
        raise ValueError(f"{where}: meta_info.output_token_logprobs: missing (was return_logprob sent?)")
    if not isinstance(top, list) or len(top) != len(tok):
        raise ValueError(f"{where}: meta_info.output_top_logprobs: expected {len(tok)} positions, got "
                         f"{len(top) if isinstance(top, list) else type(top).__name__}")
    ids, lps, top_ids, top_lps = [], [], [], []
    for t, (entry, row) in enumerate(zip(tok, top, strict=True)):
        try:
            lp, tid = float(entry[0]), int(entry[1])
        except (TypeError, ValueError, IndexError):
            raise ValueError(f"{where}: meta_info.output_token_logprobs[{t}]: expected [logprob, id, text], got "
                             f"{entry!r}") from None
        if not isinstance(row, list) or len(row) != k:
            raise ValueError(f"{where}: meta_info.output_top_logprobs[{t}]: expected {k} entries, got "
                             f"{len(row) if isinstance(row, list) else row!r}")
        ids.append(tid)
        lps.append(lp)
        top_ids.append([int(x[1]) for x in row])
        top_lps.append([float(x[0]) for x in row])
    for name, vals in (("output_token_logprobs", ids), ("output_top_logprobs", sum(top_ids, []))):
        bad = [v for v in vals if not 0 <= v < vocab_size]
        if bad:
            raise ValueError(f"{where}: meta_info.{name}: token id {bad[0]} outside [0, {vocab_size})")
    for name, vals in (("output_token_logprobs", lps), ("output_top_logprobs", sum(top_lps, []))):
        bad = [v for v in vals if not (math.isfinite(v) and v <= 1e-3)]
        if bad:
            raise ValueError(f"{where}: meta_info.{name}: log-prob {bad[0]} is not finite and <= 0")
    version = meta.get("weight_version")
    if version is not None and int(version) != weight_version:
        raise ValueError(f"{where}: meta_info.weight_version: {version}, but the trainer pushed {weight_version}")
    finish = (meta.get("finish_reason") or {}).get("type", "length")
    L = len(ids)
    routed = None
    if routed_experts is not None:
        routed = _routed_experts(meta.get("routed_experts"), where, positions=len(prompt_ids) + L - 1,
                                 layers=routed_experts[0], top_k=routed_experts[1], num_experts=routed_experts[2])
    return RolloutSample(
        prompt_index=prompt_index, prompt_ids=list(prompt_ids), response_ids=torch.tensor(ids, dtype=torch.long),
        token_logprobs=torch.tensor(lps, dtype=torch.float32),
        topk_ids=torch.tensor(top_ids, dtype=torch.long).reshape(L, k),
        topk_logprobs=torch.tensor(top_lps, dtype=torch.float32).reshape(L, k),
        finish_reason="stop" if finish == "stop" else "length", weight_version=weight_version,
        routed_experts=routed,
    )


def _routed_experts(data, where: str, *, positions: int, layers: int, top_k: int, num_experts: int) -> torch.Tensor:
    """meta_info.routed_experts (base64 of int32 [positions, layers, top_k], SGLang's encoding) -> a tensor."""
    if not isinstance(data, str):
        raise ValueError(f"{where}: meta_info.routed_experts: missing (was the server started with "
                         "--enable-return-routed-experts?)")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise ValueError(f"{where}: meta_info.routed_experts: not base64") from None
    if len(raw) != 4 * positions * layers * top_k:
        raise ValueError(f"{where}: meta_info.routed_experts: {len(raw)} bytes, expected int32 [{positions}, "
                         f"{layers}, {top_k}] = {4 * positions * layers * top_k}")
    routed = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(positions, layers, top_k)
    if routed.numel() and not (0 <= int(routed.min()) and int(routed.max()) < num_experts):
        raise ValueError(f"{where}: meta_info.routed_experts: expert ids outside [0, {num_experts})")
    return routed


class SGLangEngine:
    """`RolloutEngine` over SGLang workers serving `model_config`'s model: those at `urls`, or (urls empty)
    `launch.num_engines` that it starts itself. Disk exports go under `weight_dir` (every worker reads it)."""

    def __init__(self, urls: list[str] | tuple[str, ...], model_config, *, weight_dir,
                 launch: LaunchSpec | None = None, router: bool = False, weight_sync: str = "disk",
                 timeout: float = 60.0, retries: int = 2, backoff: float = 0.5, max_restarts: int = 2,
                 inflight_per_engine: int = 16, engine_tp: int = 1, bucket_bytes: int = 512 << 20,
                 sync_backend: str | None = None, master_address: str = "127.0.0.1", fp8_export: bool = False,
                 tokenizer_dir=None):
        if bool(urls) == (launch is not None):
            raise ValueError("rollout.urls / rollout.num_engines: give worker URLs to attach to or engines to "
                             "launch, not both and not neither")
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"rollout.weight_sync: {weight_sync!r} is not one of {', '.join(WEIGHT_SYNCS)}")
        self.model_config, self.vocab_size = model_config, model_config.vocab_size
        self.weight_dir = Path(weight_dir)
        self.launch, self.want_router, self.weight_sync = launch, router, weight_sync
        self.timeout, self.retries, self.backoff, self.max_restarts = timeout, retries, backoff, max_restarts
        self.inflight, self.bucket_bytes, self.master_address = inflight_per_engine, bucket_bytes, master_address
        self.engine_tp = launch.tp if launch else engine_tp
        self.fp8_export = fp8_export  # block-FP8 weights (q + _scale_inv) by every transport, for FP8 engines
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
    def wait_ready(self, deadline_s: float = 120.0) -> None:
        """Attached workers: wait until every one is healthy (launched ones are started by the first update)."""
        if not self.launch:
            wait_healthy(self.urls, deadline_s=deadline_s, poll_s=0.2)

    def _start(self, state: dict, version: int) -> None:
        path = self._export(state, version)
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
    def _export(self, state: dict, version: int) -> Path:
        from megatron_pdm.models.hf import save_hf_checkpoint

        path = self.weight_dir / f"v{version:06d}"
        save_hf_checkpoint(path, state, self.model_config, fp8_blocks=self.fp8_export,
                           tokenizer_dir=self.tokenizer_dir)
        self.export = (path, version)
        return path

    def update_weights(self, state: dict, version: int) -> None:
        """Push the HF-layout state to every engine (starting launched ones the first time); rollouts after this
        carry `version`."""
        self._settle()
        if self.launch and not self.procs[self.urls[0]].starts:
            self._start(state, version)
            self.weight_version = version
            return
        self.resume_memory()
        with self._lock:
            targets, self.stale = self.alive + self.stale, []
            self.alive = []
        self._post_each(targets, "/pause_generation", {})
        if self.fp8_export and self.weight_sync != "disk":  # the disk export quantizes as it writes
            from megatron_pdm.precision import fp8_block_state

            state = fp8_block_state(state)
        # each leaves in `targets` the workers that took the update
        {"disk": self._sync_disk, "distributed": self._sync_distributed, "tensor": self._sync_tensor}[
            self.weight_sync](state, version, targets)
        self._post_each(targets, "/continue_generation", {})
        with self._lock:
            self.weight_version = version
            self.alive = targets
        if self.router is not None:
            for url in targets:
                self.router.add(url)
        if not targets:
            raise RuntimeError("update_weights: no SGLang worker left")

    @staticmethod
    def _check_update(url: str, out: dict) -> None:
        if not out.get("success"):
            raise RuntimeError(f"{url}: weight update failed: {out}")

    def _post_each(self, targets: list[str], path: str, body) -> None:
        """POST `body` (or body() per worker) to every target; a worker that fails leaves `targets` and is
        restarted or dropped. A weight update that answers without success is an error."""
        for url in list(targets):
            try:
                out = self._call(url, path, body() if callable(body) else body)
            except WorkerError as e:
                targets.remove(url)
                self._failed(url, f"{path} failed ({e})")
                continue
            if path.startswith("/update_weights"):
                self._check_update(url, out)

    def _sync_disk(self, state, version, targets):
        path = self._export(state, version)
        self._post_each(targets, "/update_weights_from_disk",
                        {"model_path": str(path), "weight_version": str(version), "flush_cache": True})

    def _tensors(self, state, names):
        """The tensors as the transport needs them: on the GPU for NCCL, in host memory for gloo."""
        device = None
        if self.weight_sync == "distributed":
            device = "cpu" if self.sync_backend == "gloo" else "cuda"
        return [state[n].detach().to(device or state[n].device).contiguous() for n in names]

    def _sync_tensor(self, state, version, targets):
        groups = weight_transfer.buckets(state, self.bucket_bytes)
        for j, names in enumerate(groups):
            named = weight_transfer.shared(list(zip(names, self._tensors(state, names), strict=True)))
            last = j == len(groups) - 1

            def body(named=named, last=last):  # one pickle per engine: each is good for one reader
                return {"serialized_named_tensors": [weight_transfer.serialize_named_tensors(named)] * self.engine_tp,
                        "load_format": None, "flush_cache": last, **({"weight_version": str(version)} if last else {})}

            self._post_each(targets, "/update_weights_from_tensor", body)

    def _sync_distributed(self, state, version, targets):
        """Every bucket: announce (names, dtypes, shapes) to every engine, then broadcast the tensors from rank 0.
        A worker failing mid-way breaks the group: drop it, make a new group of the rest, send everything again."""
        while targets:  # each failed attempt removes at least one worker
            try:
                if not self._group_valid or self._group_members != tuple(targets):
                    self._init_group(targets)
                self._broadcast_state(state, version, targets)
                return
            except WorkerError as e:
                self._group_valid = False
                bad = [u for u in targets if not is_healthy(u, self.timeout)] or targets[-1:]
                for url in bad:
                    targets.remove(url)
                    self._failed(url, f"update_weights_from_distributed failed ({e})")

    def _init_group(self, targets) -> None:
        self._destroy_group()
        self._groups_made += 1
        name, port = f"megatron-pdm-weights-{self._groups_made}", free_port(self.master_address)
        world = 1 + self.engine_tp * len(targets)
        with ThreadPoolExecutor(max_workers=len(targets)) as pool:
            futs = [pool.submit(_post, url, "/init_weights_update_group",
                                {"master_address": self.master_address, "master_port": port,
                                 "rank_offset": 1 + i * self.engine_tp, "world_size": world, "group_name": name,
                                 "backend": self.sync_backend}, self.timeout) for i, url in enumerate(targets)]
            try:
                group = weight_transfer.weights_group(self.master_address, port, 0, world, name,
                                                      backend=self.sync_backend, timeout_s=self.timeout)
            except RuntimeError as e:  # a worker never joined
                raise WorkerError(f"init_weights_update_group: {e}") from None
            for f in futs:
                f.result()
        self._group, self._group_members, self._group_name, self._group_valid = group, tuple(targets), name, True

    def _destroy_group(self) -> None:
        if self._group is None:
            return
        for url in self._group_members:
            try:
                _post(url, "/destroy_weights_update_group", {"group_name": self._group_name}, self.timeout)
            except (WorkerError, ValueError):
                pass  # a dead or restarted worker holds no group
        self._group = None

    def _broadcast_state(self, state, version, targets) -> None:
        groups = weight_transfer.buckets(state, self.bucket_bytes)
        with ThreadPoolExecutor(max_workers=len(targets)) as pool:
            for j, names in enumerate(groups):
                tensors = self._tensors(state, names)
                last = j == len(groups) - 1
                body = {"names": names, "dtypes": [weight_transfer.dtype_name(t.dtype) for t in tensors],
                        "shapes": [list(t.shape) for t in tensors], "group_name": self._group_name,
                        "flush_cache": last, **({"weight_version": str(version)} if last else {})}
                futs = [pool.submit(_post, url, "/update_weights_from_distributed", body, self.timeout)
                        for url in targets]
                try:
                    weight_transfer.broadcast_tensors(self._group, tensors)
                except RuntimeError as e:
                    raise WorkerError(f"broadcast: {e}") from None
                for url, f in zip(targets, futs, strict=True):
                    self._check_update(url, f.result())

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
    def _request(self, prompt: list[int], params: SamplingParams, seed: int | None) -> dict:
        return {
            "input_ids": [prompt] * params.n,
            "sampling_params": {"temperature": params.temperature, "max_new_tokens": params.max_new_tokens,
                                "top_p": params.top_p, "top_k": params.top_k,
                                "stop_token_ids": list(params.stop_token_ids),
                                **({"sampling_seed": seed} if seed is not None else {})},
            "return_logprob": True,
            "top_logprobs_num": params.top_k_logprobs,
            "logprob_start_len": -1,  # response positions only
            **({"return_routed_experts": True} if params.return_routed_experts else {}),
        }

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
        results: dict[int, list[RolloutSample]] = {}
        failures: dict[int, int] = {}
        queue = deque(range(len(prompts)))
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
                        raise RuntimeError(f"generate: every SGLang worker failed; {len(queue)} prompts unanswered")
                    wait(restarting, timeout=1.0)
                    continue
                load = {url: 0 for url in targets}
                for url, _ in running.values():
                    load[url] = load.get(url, 0) + 1
                for url, cap in targets.items():
                    while queue and load[url] < cap:
                        i = queue.popleft()
                        seed = None if params.seed is None else params.seed * 1_000_003 + i
                        running[pool.submit(self._call, url, "/generate", self._request(prompts[i], params, seed))] = \
                            (url, i)
                        load[url] += 1
                if not running:
                    continue
                done, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
                for fut in done:
                    url, i = running.pop(fut)
                    try:
                        outs = fut.result()
                    except WorkerError as e:
                        failures[i] = failures.get(i, 0) + 1
                        if failures[i] > max_failures:
                            raise RuntimeError(f"generate: prompt {i} failed {failures[i]} times; last: {e}") from None
                        if url in self.alive:  # behind a router, the loop's _check_launched finds the dead one
                            self._failed(url, str(e))
                        log.warning("re-sending prompt %d (%s)", i, e)
                        queue.appendleft(i)
                        continue
                    if i in results:  # a prompt has one request in flight at a time; never scored twice
                        continue
                    outs = outs if isinstance(outs, list) else [outs]
                    if len(outs) != params.n:
                        raise ValueError(f"generate output for prompt {i}: expected {params.n} samples, got "
                                         f"{len(outs)}")
                    results[i] = [parse_generate_output(o, prompt_index=i, prompt_ids=prompts[i],
                                                        k=params.top_k_logprobs, vocab_size=self.vocab_size,
                                                        weight_version=self.weight_version, routed_experts=routed)
                                  for o in outs]
        return [s for i in range(len(prompts)) for s in results[i]]

    def _check_launched(self) -> None:
        """Restart every launched worker that has exited (behind a router a failure does not name the worker, and
        the router retries elsewhere, so this is how we notice)."""
        for url, proc in self.procs.items():
            if url in self.alive and not proc.running():
                self._failed(url, "process exited")
