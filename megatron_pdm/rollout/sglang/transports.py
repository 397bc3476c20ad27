"""Weight transports: how an update's HF-layout weights reach the SGLang workers of a `WorkerPool`.

Every transport's `send(weights, version, targets)` takes the engine weights (`engine_weights`: a full dict, or a
stream of bucket dicts consumed one at a time and never all held) and leaves in `targets` the workers that took
them (a failed one is restarted or dropped by the pool, with a log line). The pool pauses generation around it.

- `DiskTransport` ("disk"): an HF export under the weight dir (a full dict, one file; a stream, one safetensors
  shard per bucket and the index), then /update_weights_from_disk on each worker. Works everywhere. Costs: every
  byte written once and read by every worker.
- `DistributedTransport` ("distributed"): per bucket of at most `bucket_bytes`, an announcement
  (/update_weights_from_distributed) and one broadcast per tensor over a process group of the trainer (rank 0) and
  every engine rank (NCCL on GPUs, gloo on a CPU), for engines on other nodes. Costs: each bucket moved to the
  group's device (a host copy for gloo), sent once per engine rank.
- `TensorTransport` ("tensor"): per bucket, shared-memory handles to the tensors (/update_weights_from_tensor: CUDA
  IPC on a GPU; on a CPU a shared-memory copy of the bucket), for colocated engines. Costs: one pickle of handles
  per engine rank (each rank maps its own: SGLang 0.5.23 deserializes only its rank's entry, and CUDA IPC counts
  references per pickle); a CPU bucket copied once. SGLang answers before its copies ran on the device, so every
  bucket of an update stays alive until the update's session is closed: the update's weights, in the engine's
  dtype, on the sender at once (a transport for engines on the same node as rank 0).

Tensor and distributed updates run inside a weight-update session (`WorkerPool.update`, `needs_session`).

A stream's last bucket is not known before it ends, so the broadcast and tensor transports commit the version (and
flush the cache) with every bucket of a stream (generation is paused throughout); a full dict commits with its
last bucket only. Weights travel in the engine's dtype, or block-FP8 (float8_e4m3fn + `_scale_inv` per 128 x 128
block) to FP8 engines (`fp8_export.engine_quantization`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import torch

from ..base import Weights, weight_buckets
from . import weight_transfer
from .fp8_export import engine_quantization
from .health import is_healthy
from .launcher import free_port
from .pool import Rejected, UpdateAborted, WorkerError, WorkerPool, get_info, post
from .wire import SERVE_VERSION

WEIGHT_SYNCS = ("disk", "distributed", "tensor")
REFUSAL_GRACE_S = 5.0  # a failed announcement with the broadcast still in flight: how long until it counts as refused

log = logging.getLogger(__name__)


# -- what the engines take ------------------------------------------------------------------------------------------
class EngineProbe(NamedTuple):
    """What an attached engine takes: `quantization` (`engine_quantization`); `serve`, whether it is
    `megatron-pdm serve` (/server_info version SERVE_VERSION), which takes distributed updates over gloo only; and
    `cpu`, whether it is SGLang on a CPU (/server_info device "cpu"), which /release_memory_occupation kills."""

    quantization: str | None
    serve: bool
    cpu: bool = False


def probe_engines(urls, timeout: float) -> dict[str, EngineProbe]:
    """url -> `EngineProbe` of every attached engine: two GETs each (/server_info: the launch's arguments;
    /model_info: the weights served now, which SGLang's /server_info does not follow) and a read of its current
    checkpoint's config.json (the launch's checkpoint's where that one is gone: an export that a later one replaced,
    served still by an engine whose update failed)."""
    found = {}
    for url in urls:
        info = get_info(url, "server_info", timeout)
        path, config = None, None
        for path in dict.fromkeys((get_info(url, "model_info", timeout).get("model_path"), info.get("model_path"))):
            try:
                config = json.loads((Path(str(path)) / "config.json").read_text())
                break
            except (OSError, ValueError):
                continue
        serve = info.get("version") == SERVE_VERSION
        found[url] = EngineProbe(engine_quantization(url, info.get("quantization"), path, config), serve,
                                 info.get("device") == "cpu" and not serve)
    return found


def engine_state(state: Mapping[str, torch.Tensor], *, fp8: bool, dtype: str | None) -> Mapping[str, torch.Tensor]:
    """The tensors the engines take: block-FP8 pairs (q float8_e4m3fn, `_scale_inv` float32) for the linear
    weights of FP8 engines, quantized from the trainer's values, and everything else in the engine's dtype (None:
    as given; the expert bias stays float32). Idempotent: what the trainer's senders converted already
    (`train.weight_sync`) passes through. Costs: one new tensor per converted weight (none when nothing
    converts)."""
    from megatron_pdm.models.hf import export_dtype
    from megatron_pdm.precision import FP8_SCALE_SUFFIX, fp8_block_state

    if fp8:
        state = fp8_block_state(state)
    if dtype is None:
        return state
    to = getattr(torch, dtype)
    return {n: t if t.dtype == torch.float8_e4m3fn or n.endswith(FP8_SCALE_SUFFIX) else t.to(export_dtype(n, to))
            for n, t in state.items()}


def engine_weights(weights: Weights, *, fp8: bool, dtype: str | None) -> Weights:
    """`engine_state` of a full dict, or of each bucket of a stream as it comes (lazily: one bucket at a time)."""
    if isinstance(weights, Mapping):
        return engine_state(weights, fp8=fp8, dtype=dtype)
    return (engine_state(bucket, fp8=fp8, dtype=dtype) for bucket in weights)


def write_export(weights: Weights, path: Path, model_config, *, fp8: bool, dtype: str | None, tokenizer_dir) -> Path:
    """An HF checkpoint of the engine weights at `path` (a full dict, one file; a stream, one shard per bucket),
    with the trainer's tokenizer files; FP8 engines' exports carry the block-FP8 quantization_config."""
    from megatron_pdm.models.hf import save_hf_checkpoint

    save_hf_checkpoint(path, weights, model_config, tokenizer_dir=tokenizer_dir,
                       extra_config=_export_config(fp8, dtype))
    return path


def finish_export(path: Path, weight_map: dict[str, str], nbytes: int, model_config, *, fp8: bool, dtype: str | None,
                  tokenizer_dir) -> Path:
    """Complete an export whose shards the trainer's pipeline stages wrote under `path` themselves, in the engine's
    format (`weight_map`: HF key -> file, `nbytes` in all): the index, the tokenizer files and config.json (as
    `write_export` writes them), config.json last."""
    from megatron_pdm.models.hf import finish_hf_checkpoint

    finish_hf_checkpoint(path, weight_map, nbytes, model_config, tokenizer_dir=tokenizer_dir,
                         extra_config=_export_config(fp8, dtype))
    return path


def _export_config(fp8: bool, dtype: str | None) -> dict:
    """What an export's config.json adds to the model's: the block-FP8 quantization_config, the engine's dtype."""
    from megatron_pdm.precision import FP8_QUANTIZATION_CONFIG

    return {**({"quantization_config": FP8_QUANTIZATION_CONFIG} if fp8 else {}),
            **({"torch_dtype": dtype} if dtype else {})}


def sub_buckets(weights: Weights, bucket_bytes: int) -> Iterator[tuple[Mapping, list[str], bool]]:
    """(state, names, commit) per transport bucket of at most bucket_bytes: a full dict cut as before, with
    `commit` (the update's weight_version and a cache flush) on its last bucket only; a stream cut bucket by
    bucket, every one committing (the last is not known before the stream ends, and generation is paused
    throughout, so no rollout sees the version before all weights are in)."""
    full = isinstance(weights, Mapping)
    for state in weight_buckets(weights):
        groups = weight_transfer.buckets(state, bucket_bytes)
        for j, names in enumerate(groups):
            yield state, names, not full or j == len(groups) - 1
        del state


def _tensors(state: Mapping, names: list[str], device) -> list[torch.Tensor]:
    """The named tensors, contiguous, on `device` (None: where they are): a copy only where they are not so."""
    return [state[n].detach().to(device or state[n].device).contiguous() for n in names]


# -- the transports -------------------------------------------------------------------------------------------------
class DiskTransport:
    """/update_weights_from_disk of an export that `export(weights, version)` writes (and the pool restarts from)."""

    needs_session = False

    def __init__(self, pool: WorkerPool, export: Callable[[Weights, int], Path]):
        self.pool, self.export = pool, export

    def send(self, weights: Weights, version: int, targets: list[str]) -> None:
        self.load(self.export(weights, version), version, targets)

    def load(self, path: Path, version: int, targets: list[str]) -> None:
        """Every target loads the complete export at `path` (written by `export`, or by the trainer's stages)."""
        self.pool.post_each(targets, "/update_weights_from_disk",
                            {"model_path": str(path), "weight_version": str(version), "flush_cache": True})

    def close(self) -> None:
        pass


class TensorTransport:
    """/update_weights_from_tensor per bucket: one pickle of shared-memory handles per engine rank."""

    needs_session = True

    def __init__(self, pool: WorkerPool, *, engine_tp: int, bucket_bytes: int):
        self.pool, self.engine_tp, self.bucket_bytes = pool, engine_tp, bucket_bytes

    def send(self, weights: Weights, version: int, targets: list[str]) -> list:
        """Every bucket to every target; returns the buckets' shared tensors, which the caller keeps alive until the
        engines' session is closed (SGLang answers before its device copies ran)."""
        sent = []
        for state, names, commit in sub_buckets(weights, self.bucket_bytes):
            named = weight_transfer.shared(list(zip(names, _tensors(state, names, None), strict=True)))
            del state

            def body(named=named, commit=commit):  # one pickle per engine rank: each is good for one reader
                return {"serialized_named_tensors": [weight_transfer.serialize_named_tensors(named)
                                                     for _ in range(self.engine_tp)],
                        "load_format": None, "flush_cache": commit,
                        **({"weight_version": str(version)} if commit else {})}

            self.pool.post_each(targets, "/update_weights_from_tensor", body)
            sent.append(named)
            del named, body
            if not targets:
                break
        return sent

    def close(self) -> None:
        pass


def _succeeded(future) -> bool:
    try:
        return bool(future.result().get("success"))
    except (WorkerError, Rejected):
        return False


def _answer(future) -> str:
    try:
        return str(future.result())
    except (WorkerError, Rejected) as e:
        return str(e)


def failed_updates(futures: dict) -> list[str]:
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


class DistributedTransport:
    """Bucketed broadcasts over a process group of one trainer rank (the group's rank 0: global rank 0, or a later
    pipeline stage's sender, `StageSender`) and every engine rank, made on first use and again whenever its
    members change (a worker failed, restarted or rejoined). `pool`: the WorkerPool on global rank 0, or a stage
    sender's `StageEngines` (its timeouts, and where the engines that fail under its broadcasts are recorded)."""

    needs_session = True

    def __init__(self, pool: WorkerPool, *, engine_tp: int, bucket_bytes: int, backend: str,
                 master_address: str | None, label: str = "", rank0: bool = True):
        self.pool, self.engine_tp, self.bucket_bytes = pool, engine_tp, bucket_bytes
        self.backend, self.label, self.rank0 = backend, label, rank0
        self.master_address = master_address  # None: weight_transfer.trainer_address picks it
        self.group, self.members, self.valid, self.groups_made, self.name = None, (), False, 0, ""

    def forget(self, url: str) -> None:
        """`url` left service: a restarted worker on the same URL is a new member, so the group must be made anew."""
        if url in self.members:
            self.valid = False

    def send(self, weights: Weights, version: int, targets: list[str]) -> None:
        """Every bucket: announce (names, dtypes, shapes) to every engine, then broadcast the tensors from rank 0.
        A worker failing after the broadcast (its load failed) breaks the group: drop it, make a new group of the
        rest, and send the bucket again (loading a bucket twice is harmless; the buckets before it are in every
        remaining engine). A worker refusing before it took part aborts the update (`_broadcast_bucket`)."""
        # this rank's own GPU (torch.cuda.current_device() of the caller's thread: rank 0's, or a stage sender's)
        device = torch.device("cpu") if self.backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        for state, names, commit in sub_buckets(weights, self.bucket_bytes):
            tensors = _tensors(state, names, device)
            del state
            while targets:  # each failed attempt removes at least one worker
                try:
                    if not self.valid or self.members != tuple(targets):
                        self._init_group(targets)
                    self._broadcast_bucket(names, tensors, version if commit else None, targets)
                    break
                except WorkerError as e:
                    self.valid = False
                    bad = [u for u in e.urls if u in targets] or \
                        [u for u in targets if not is_healthy(u, self.pool.timeout)] or targets[-1:]
                    for url in bad:
                        targets.remove(url)
                        self.pool.failed(url, f"update_weights_from_distributed failed ({e})")
            del tensors
            if not targets:
                return

    def _init_group(self, targets: list[str]) -> None:
        """A process group of the trainer (rank 0) and every engine rank, built on both sides as SGLang builds it
        (weight_transfer.custom_process_group), at the trainer's reachable address. Rank 0's side runs on a thread
        of its own, watched with the engines' answers: an engine answering /init_weights_update_group with a
        failure never joins, so the update fails at once naming it (WorkerError), not after the group's timeout
        (the abandoned side ends with that timeout, and a group it still makes is destroyed)."""
        self.close()
        self.groups_made += 1
        timeout = self.pool.timeout
        address = weight_transfer.trainer_address(targets, self.master_address, rank0=self.rank0)
        name = f"megatron-pdm{self.label}-{os.getpid()}-{id(self) % 65536:x}-{self.groups_made}"
        port = free_port("")
        world = 1 + self.engine_tp * len(targets)
        made, lock, ready = {}, threading.Lock(), threading.Event()

        def make():
            try:
                group = weight_transfer.custom_process_group(address, port, 0, world, name, backend=self.backend,
                                                             timeout_s=timeout)
            except Exception as e:  # raised in the caller's thread (RuntimeError: a worker never joined)
                made["error"] = e
            else:
                with lock:
                    if made.get("abandoned"):
                        weight_transfer.destroy_group(group)
                        return
                    made["group"] = group
            finally:
                ready.set()

        pool = ThreadPoolExecutor(max_workers=len(targets))
        try:
            futs = {url: pool.submit(post, url, "/init_weights_update_group",
                                     {"master_address": address, "master_port": port,
                                      "rank_offset": 1 + i * self.engine_tp, "world_size": world, "group_name": name,
                                      "backend": self.backend}, self.pool.update_timeout)
                    for i, url in enumerate(targets)}
            threading.Thread(target=make, name="weights-group", daemon=True).start()
            while not ready.wait(0.01):
                refused = [u for u, f in futs.items() if f.done() and not _succeeded(f)]
                if refused:
                    with lock:
                        made["abandoned"] = True
                        group = made.pop("group", None)
                    if group is not None:
                        weight_transfer.destroy_group(group)
                    raise WorkerError(f"init_weights_update_group refused by {', '.join(refused)} "
                                      f"({_answer(futs[refused[0]])}): it never joins the weights group", refused)
            if "error" in made:
                if not isinstance(made["error"], RuntimeError):
                    raise made["error"]
                raise WorkerError(f"init_weights_update_group at {address}:{port}: {made['error']}",
                                  failed_updates(futs))
            group = made["group"]
            bad = failed_updates(futs)
        finally:
            pool.shutdown(wait=False)  # after a refusal, the others' joins end with their timeout, unwaited
        if bad:
            weight_transfer.destroy_group(group)
            raise WorkerError(f"init_weights_update_group failed on {bad}", bad)
        self.group, self.members, self.name, self.valid = group, tuple(targets), name, True
        log.info("weights group %s: the trainer at %s:%d and %d engine rank(s)", name, address, port, world - 1)

    def _broadcast_bucket(self, names, tensors, version: int | None, targets) -> None:
        """One /update_weights_from_distributed per engine (the announcement; `version` and a cache flush when it
        commits) and the broadcast of its tensors, watched together until every broadcast completed.

        With NCCL, `Work.wait()` returns once the kernel is queued on the stream (only the first collective on a new
        group blocks the host, in the communicator's init, until every member joined): it says nothing about the
        transfer. So a thread of its own only starts the broadcasts (`start_broadcast`, which may block in that
        init), and this loop polls `Work.is_completed()` (no host sync) with the engines' answers. An engine
        answering with a failure while a broadcast is incomplete gets a grace period (`REFUSAL_GRACE_S`: it may
        have failed its load after receiving, while a slower member has not received yet); if the broadcast has
        not completed by then, the engine never took part: the group is aborted, never destroyed (destroying a
        communicator with a kernel in flight hangs), and the update fails (UpdateAborted, naming it), whatever the
        bucket. So does a broadcast that does not complete within the update timeout. Once every broadcast
        completed, `wait()` raises what a gloo broadcast failed with. Polls every 10 ms."""
        body = {"names": names, "dtypes": [weight_transfer.dtype_name(t.dtype) for t in tensors],
                "shapes": [list(t.shape) for t in tensors], "group_name": self.name,
                "flush_cache": version is not None, **({} if version is None else {"weight_version": str(version)})}
        pool = ThreadPoolExecutor(max_workers=len(targets))
        try:
            futs = {url: pool.submit(post, url, "/update_weights_from_distributed", body, self.pool.update_timeout)
                    for url in targets}
            started, errors, works = threading.Event(), [], []

            def broadcast(group=self.group):
                try:  # a new thread's current GPU is cuda:0: the works go on the tensors' own (a stage's sender)
                    with torch.cuda.device(tensors[0].device) if tensors and tensors[0].is_cuda else nullcontext():
                        works.extend(weight_transfer.start_broadcast(group, tensors))
                except Exception as e:  # any failure: raised in the caller's thread
                    errors.append(e)
                finally:
                    started.set()

            threading.Thread(target=broadcast, name="weights-broadcast", daemon=True).start()
            deadline, refused_at = time.monotonic() + self.pool.update_timeout, None
            while not (started.is_set() and (errors or all(w.is_completed() for w in works))):
                refused = [u for u, f in futs.items() if f.done() and not _succeeded(f)]
                now = time.monotonic()
                refused_at = refused_at or (now if refused else None)
                if (refused and now - refused_at > REFUSAL_GRACE_S) or now > deadline:
                    self._abort()
                    why = (f"refused by {', '.join(refused)} ({_answer(futs[refused[0]])}) before it took part"
                           if refused else f"did not complete within {self.pool.update_timeout:.0f} s")
                    raise UpdateAborted(f"update_weights_from_distributed: the broadcast of a bucket was {why}; the "
                                        "weights group is aborted and the other engines wait in its broadcast until "
                                        "their own timeout: the update failed",
                                        stuck=[u for u in targets if u not in refused], refused=refused)
                time.sleep(0.01)
            for w in works if not errors else ():
                try:
                    w.wait()  # completed: gloo raises what it failed with; NCCL orders the current stream after it
                except RuntimeError as e:
                    errors.append(e)
                    break
            if errors:
                raise WorkerError(f"broadcast: {errors[0]}")
            bad = failed_updates(futs)
        finally:
            pool.shutdown(wait=False)  # after an abort, stuck announcements end with their timeout, unwaited
        if bad:  # they failed their load after the broadcast: a new group of the others gets the bucket again
            raise WorkerError(f"update_weights_from_distributed failed on {bad}", bad)

    def _abort(self) -> None:
        """Abort the group here (NCCL kernels in flight stop; gloo work ends with its timeout) and forget it."""
        weight_transfer.abort_group(self.group)
        self.group, self.valid, self.members = None, False, ()

    def close(self) -> None:
        """Destroy the group on every member (a dead or restarted one holds none) and here."""
        if self.group is None:
            return
        for url in self.members:
            try:
                post(url, "/destroy_weights_update_group", {"group_name": self.name}, self.pool.timeout)
            except (WorkerError, ValueError):
                pass
        weight_transfer.destroy_group(self.group)
        self.group = None


# -- later pipeline stages' own groups ------------------------------------------------------------------------------
class StageEngines:
    """What a later pipeline stage's sender knows of the engines during one staged update (`StageSender`): the
    timeouts of rank 0's pool, and the engines that failed under its broadcasts, with why, reported to rank 0 (whose
    pool restarts or drops them)."""

    def __init__(self, timeout: float, update_timeout: float):
        self.timeout, self.update_timeout, self.failures = timeout, update_timeout, {}

    def failed(self, url: str, why: str) -> None:
        self.failures[url] = why


class StageSender:
    """A later pipeline stage's sender under distributed sync: its stage's buckets broadcast to every engine rank
    over a weights group of its own (a `DistributedTransport` whose rank 0 is this sender, at this host's address),
    kept across updates and made anew when rank 0's plan says one of its members left service since (`left`: a
    worker restarted on the same URL is a new member) or the engines' setup changed. SGLang receives each
    announced bucket from src 0 of the named group, so every stage needs a group; the stages take turns (an engine
    takes one announcement or group init at a time: two stages' reaching two engines in opposite orders would wait
    on each other forever), which rank 0 opens with the plan (`SGLangEngine.update_weights_by_stages`)."""

    def __init__(self, stage: int):
        self.stage, self.transport, self.setup, self.left = stage, None, None, {}

    def send(self, buckets, version: int, plan: dict) -> dict:
        """Send `buckets` (a stream of HF-layout dicts in the engines' format) to plan["targets"] as `version`;
        the report for rank 0: {"stage", "failed": {url: why}, "aborted": None or {"message", "stuck", "refused"}}.
        The stream drives the stage's gathers: the caller runs what is left of it, whatever happened here."""
        setup = tuple(plan[k] for k in ("engine_tp", "bucket_bytes", "backend", "timeout", "update_timeout"))
        engines = StageEngines(plan["timeout"], plan["update_timeout"])
        if self.transport is None or setup != self.setup:
            self.close()
            self.transport = DistributedTransport(engines, engine_tp=plan["engine_tp"],
                                                  bucket_bytes=plan["bucket_bytes"], backend=plan["backend"],
                                                  master_address=None, label=f"-pp{self.stage}", rank0=False)
            self.setup = setup
        self.transport.pool = engines
        if any(plan["left"].get(url, 0) != self.left.get(url, 0) for url in self.transport.members):
            self.transport.valid = False
        self.left = dict(plan["left"])
        aborted = None
        try:
            self.transport.send(buckets, version, list(plan["targets"]))
        except UpdateAborted as e:
            aborted = {"message": f"stage {self.stage}: {e}", "stuck": list(e.stuck), "refused": list(e.refused)}
        return {"stage": self.stage, "failed": engines.failures, "aborted": aborted}

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.transport = None
