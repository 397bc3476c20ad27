"""`SGLangEngine`: a `RolloutEngine` over SGLang HTTP workers (or `megatron-pdm serve`, which speaks the same API).

The engine composes three parts: the worker pool (`pool.py`: attached or launched workers, routing, retries,
restarts, health, sglang-router), the weight transports (`transports.py`: disk, distributed, tensor) and the wire
format (`wire.py`, shared with `server.py`). Launched workers start from the first weights it is given.

Responses are validated (ids in range, finite log-probs, K as asked) and must carry the weight version the trainer
pushed last, so that a rollout is never scored against the wrong weights. Each of the n samples of a prompt has its
own `sampling_seed` (SGLang honours seeds only with --enable-deterministic-inference, and then n copies with one
seed would be n equal samples).

`update_weights` takes a full state dict or a stream of buckets (the trainer's `train.weight_sync.sync_weights`),
consumed one at a time, converted to what the engines take (their dtype, or block-FP8 for FP8 engines: those we
launch when `quantization` is "fp8", and attached ones that say so in /server_info and their checkpoint's
`quantization_config`). Generation is paused around every update; an engine whose update fails (SGLang answers
HTTP 400 with success false) is restarted when we launched it, else dropped, with a log line, and generation
resumes on the others. An engine restarted between updates loads the last disk export and rejoins when it holds
the current version (at once under "disk", at the next update otherwise).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from ..base import RolloutSample, SamplingParams, TeacherScores, Weights, check_score_inputs, sample_seeds
from .health import wait_healthy
from .launcher import LaunchSpec
from .pool import UpdateAborted, WorkerPool
from .pool import post as _post  # noqa: F401  (tests/gpu/test_sglang_engine.py imports it from here)
from .transports import (
    WEIGHT_SYNCS,
    DiskTransport,
    DistributedTransport,
    TensorTransport,
    engine_weights,
    finish_export,
    probe_engines,
    write_export,
)
from .wire import generate_request, parse_generate_output, parse_score_output, score_request

__all__ = ["WEIGHT_SYNCS", "SGLangEngine"]

QUANTIZATIONS = (None, "fp8")
DTYPES = ("float32", "bfloat16", "float16")

log = logging.getLogger(__name__)


def transport_backend(serve: bool) -> str:
    """The distributed weight transport's backend: NCCL for SGLang engines under CUDA (they receive into their
    GPUs); gloo without CUDA, and for `megatron-pdm serve` (`serve`) on any host: it receives into CPU tensors
    (server.py), which an NCCL group cannot take."""
    return "nccl" if torch.cuda.is_available() and not serve else "gloo"


class SGLangEngine:
    """`RolloutEngine` over SGLang workers serving `model_config`'s model, as the `rollout` section and its
    `sglang` sub-section (`s`) say: those at `s.urls`, or (urls empty) the `launch.num_engines` that it starts
    itself, behind sglang-router when `s.router`; per request `s.timeout_s` + max_new_tokens / `s.tokens_per_s`,
    re-sent up to `s.retries` times (`backoff` seconds apart) on `inflight_per_engine` connections per engine, a
    failed launched engine restarted up to `s.max_restarts` times; weights by `s.weight_sync` in buckets of
    `rollout.sync_bucket_bytes` (one update at most `s.update_timeout_s`). Disk exports go under `weight_dir` (every
    worker reads it). `weight_sync` (one of WEIGHT_SYNCS) may be changed between updates."""

    def __init__(self, rollout, model_config, *, weight_dir, launch: LaunchSpec | None = None,
                 quantization: str | None = None, dtype: str | None = None, tokenizer_dir=None,
                 sync_backend: str | None = None, master_address: str | None = None, backoff: float = 0.5,
                 inflight_per_engine: int = 16):
        s = rollout.sglang
        urls, weight_sync, engine_tp = s.urls, s.weight_sync, s.engine_tp
        if bool(urls) == (launch is not None):
            raise ValueError("rollout.sglang.urls / rollout.sglang.num_engines: give worker URLs to attach to or "
                             "engines to launch, not both and not neither")
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"rollout.sglang.weight_sync: {weight_sync!r} is not one of {', '.join(WEIGHT_SYNCS)}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"rollout quantization: {quantization!r} is not one of {QUANTIZATIONS}")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"rollout dtype: {dtype!r} is not float32, bfloat16 or float16")
        self.model_config, self.vocab_size = model_config, model_config.vocab_size
        self.weight_dir, self.tokenizer_dir = Path(weight_dir), tokenizer_dir  # tokenizer: copied into every export
        self.weight_sync, self.quantization, self.dtype = weight_sync, quantization, dtype
        engine_tp = launch.tp if launch else engine_tp
        # block-FP8 weights (q + _scale_inv) by every transport: launched FP8 engines start from a block-FP8 export;
        # attached engines are asked (wait_ready)
        self.fp8: bool | None = quantization == "fp8" if launch else None
        if quantization == "fp8":
            from megatron_pdm.precision import check_fp8_block_shapes

            check_fp8_block_shapes(model_config, engine_tp)
        self._warned_truncation = False
        self.release = s.release_memory  # refused for CPU SGLang engines (`_probe`)
        self.pool = WorkerPool(urls, launch=launch, router=s.router, timeout=s.timeout_s,
                               retries=s.retries, backoff=backoff, max_restarts=s.max_restarts,
                               inflight=inflight_per_engine, update_timeout=s.update_timeout_s,
                               tokens_per_s=s.tokens_per_s,
                               on_failed=self._forget)
        bucket_bytes = rollout.sync_bucket_bytes
        # launched engines: the launch spec says which server they run; attached ones are asked (`_probe`)
        self.sync_backend = sync_backend  # given: kept whatever the engines are
        backend = sync_backend or transport_backend(launch is not None and launch.server == "megatron-pdm")
        self.engine_tp, self.left = engine_tp, {}  # url -> times it left service (stage groups holding it: anew)
        self.transports = {
            "disk": DiskTransport(self.pool, self._export),
            "distributed": DistributedTransport(self.pool, engine_tp=engine_tp, bucket_bytes=bucket_bytes,
                                                backend=backend, master_address=master_address, label="-pp0"),
            "tensor": TensorTransport(self.pool, engine_tp=engine_tp, bucket_bytes=bucket_bytes),
        }

    def _forget(self, url: str) -> None:
        """`url` left service: every weights group holding it is made anew at the next update (rank 0's now, a later
        stage's sender's when the plan's `left` says so)."""
        self.transports["distributed"].forget(url)
        self.left[url] = self.left.get(url, 0) + 1

    @property
    def weight_version(self) -> int:
        """The version the trainer pushed last (-1: none yet); every rollout must carry it."""
        return self.pool.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.pool.weight_version = version

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self, deadline_s: float = 120.0) -> None:
        """The protocol's start: `wait_ready`."""
        self.wait_ready(deadline_s)

    def wait_ready(self, deadline_s: float = 120.0) -> None:
        """Attached workers: wait until every one is healthy and learn what weights they take (launched ones are
        started by the first update)."""
        if not self.pool.launch:
            wait_healthy(self.pool.urls, deadline_s=deadline_s, poll_s=0.2)
            self._probe()

    def _probe(self) -> None:
        """Ask every attached engine whether it is FP8 (block-FP8 weights) or not, whether it is `megatron-pdm
        serve`, and whether it is SGLang on a CPU, where rollout.sglang.release_memory is refused (`probe_engines`).
        They must agree with each other and with `quantization` (precision.rollout); any serve among them makes the
        distributed transport gloo (`transport_backend`; SGLang takes a gloo group too, into its GPUs), before its
        first group is made."""
        found = probe_engines(self.pool.urls, self.pool.timeout)
        cpu = [url for url, probe in found.items() if probe.cpu]
        if self.release and cpu:
            raise ValueError(f"rollout.sglang.release_memory: true, but the SGLang engine at {cpu[0]} runs on a CPU "
                             "(/server_info device 'cpu'), which /release_memory_occupation kills (SGLang 0.5.23); "
                             "set rollout.sglang.release_memory false")
        for url, probe in found.items():
            if probe.quantization != self.quantization:
                raise ValueError(f"precision.rollout: the config asks for {self.quantization or 'unquantized'} "
                                 f"rollout engines, but the engine at {url} is {probe.quantization or 'unquantized'} "
                                 f"({', '.join(f'{u}: {p.quantization}' for u, p in found.items())})")
        self.fp8 = self.quantization == "fp8"
        transport = self.transports["distributed"]
        backend = self.sync_backend or transport_backend(any(p.serve for p in found.values()))
        if backend != transport.backend:
            transport.close()  # a group of the other backend (none before the first update): made anew
            transport.backend, transport.valid = backend, False

    def close(self) -> None:
        """Stop restarts, destroy the weights groups, then stop the router and every launched worker: whatever a
        group's teardown raises (or a second SIGTERM interrupting it), the workers are stopped."""
        self.pool.stop_restarts()
        try:
            for transport in self.transports.values():
                transport.close()
        finally:
            self.pool.close()

    def health(self) -> bool:
        return self.pool.health()

    def _settle(self) -> None:
        self.pool.settle()

    def _check_launched(self) -> None:
        self.pool.check_launched()

    # -- memory (colocated engines) -----------------------------------------------------------------------------
    def release_memory(self) -> None:
        """Colocated engines: free the weights and KV cache on every worker while the trainer uses the GPUs."""
        self.pool.release_memory()

    def resume_memory(self) -> None:
        """Take the memory back (before the next weight update); a no-op unless released."""
        self.pool.resume_memory()

    # -- weights ------------------------------------------------------------------------------------------------
    def _export(self, weights: Weights, version: int) -> Path:
        """The export v<version> under weight_dir (every byte written once), recorded for restarts; the one it
        replaces is deleted (`WorkerPool.record_export`), so the disk holds at most two exports at a time."""
        path = write_export(weights, self.weight_dir / f"v{version:06d}", self.model_config, fp8=self.fp8,
                            dtype=self.dtype, tokenizer_dir=self.tokenizer_dir)
        self.pool.record_export(path, version)
        return path

    def export_directory(self, version: int) -> Path | None:
        """Under disk sync, and for the update that launches the engines: v<version> under weight_dir, where the
        trainer's pipeline stages write their own shards (`update_weights_from_export`); None otherwise."""
        if self.weight_sync != "disk" and not self.pool.needs_launch:
            return None
        return self.weight_dir / f"v{version:06d}"

    def update_weights_from_export(self, directory, weight_map: dict[str, str], nbytes: int, version: int, *,
                                   dtype: str, fp8: bool) -> None:
        """The export at `directory` (`export_directory(version)`), whose shards the trainer's stages wrote in the
        format (`dtype`, block-FP8 linear weights when `fp8`; `weight_map`: HF key -> file), which must be the
        engines' (ValueError before anything loads), completed here (index, tokenizer, config.json last) and
        recorded for restarts, then loaded by every engine (or launching them) as `update_weights` loads its own."""
        self._ready_for_update()
        self._check_format(dtype, fp8)
        path = finish_export(Path(directory), weight_map, nbytes, self.model_config, fp8=self.fp8, dtype=self.dtype,
                             tokenizer_dir=self.tokenizer_dir)
        self.pool.record_export(path, version)
        if self.pool.needs_launch:
            self.pool.launch_all(path, version)
            self.weight_version = version
            return
        self.pool.update(version, lambda targets: self.transports["disk"].load(path, version, targets))

    def takes_stage_broadcasts(self, single_node: bool = True) -> bool:
        """Under distributed sync (engines running): each pipeline stage's sender broadcasts its own weights over a
        group of its own (`update_weights_by_stages`); not when the trainer spans several nodes (`single_node`
        False) and an engine's URL is a loopback address (launched engines bind 127.0.0.1), which the senders on
        other nodes cannot reach: then the later stages relay through rank 0."""
        from urllib.parse import urlparse

        from .weight_transfer import is_loopback

        if self.weight_sync != "distributed" or self.pool.needs_launch:
            return False
        return single_node or not any(is_loopback(urlparse(u).hostname or "") for u in self.pool.urls)

    def update_weights_by_stages(self, version: int, send, *, dtype: str, fp8: bool) -> None:
        """One distributed update whose weights come from each pipeline stage's sender in turn, in the format
        (`dtype`, block-FP8 when `fp8`) that must be the engines'. Generation is paused and a weight-update session
        opened on every engine (`WorkerPool.update`); then `send(own, next_plan)` runs the stages: own(weights)
        sends stage 0's stream through this engine's transport; next_plan(report) takes the report of the stage
        before (None for stage 0's) and gives the plan of the next one (`StageSender.send`: the engines in service,
        their TP size, the bucket size, the backend, the timeouts and how often each engine left service), or None
        once a stage was aborted (the later ones are skipped). Stages go one after another, never at once: an
        engine takes announcements one at a time (SGLang's scheduler), so two stages' broadcasts (or group
        inits) reaching two engines in opposite orders would wait on each other forever. Engines a stage saw fail
        are restarted or dropped at once (out of the later stages' plans); an aborted stage fails the update
        (UpdateAborted), a stage's sender that failed otherwise too (RuntimeError naming it)."""
        self._ready_for_update()
        self._check_format(dtype, fp8)
        transport = self.transports["distributed"]

        def run(targets: list[str]) -> None:
            aborted = []

            def next_plan(report: dict | None) -> dict | None:
                if report is not None:
                    if "error" in report:
                        raise RuntimeError(f"update_weights: stage {report['stage']}'s sender failed: "
                                           f"{report['error']}")
                    if report["aborted"]:
                        aborted.append(report["aborted"])
                    gone = set() if not report["aborted"] else {*report["aborted"]["stuck"],
                                                                *report["aborted"]["refused"]}
                    for url, why in report["failed"].items():
                        if url in targets and url not in gone:
                            targets.remove(url)
                            self.pool.failed(url, f"stage {report['stage']}: {why}")
                if aborted or not targets:
                    return None
                return {"targets": list(targets), "engine_tp": self.engine_tp, "bucket_bytes": transport.bucket_bytes,
                        "backend": transport.backend, "timeout": self.pool.timeout,
                        "update_timeout": self.pool.update_timeout, "left": dict(self.left)}

            send(lambda weights: transport.send(weights, version, targets), next_plan)
            if aborted:
                raise UpdateAborted("; ".join(a["message"] for a in aborted),
                                    stuck=sorted({u for a in aborted for u in a["stuck"]}),
                                    refused=sorted({u for a in aborted for u in a["refused"]}))

        self.pool.update(version, run, session=True)

    def _ready_for_update(self) -> None:
        """Before an update: restarts settled, and attached engines asked what weights they take (once)."""
        self.pool.settle()
        if self.fp8 is None:
            self._probe()

    def _check_format(self, dtype: str, fp8: bool) -> None:
        """ValueError unless weights in `dtype` (block-FP8 linear weights when `fp8`) are what the engines take."""
        if fp8 != self.fp8 or self.dtype not in (None, dtype):
            raise ValueError(f"precision.rollout: the trainer sends {'block-FP8' if fp8 else dtype} weights, but the "
                             f"engines take {'block-FP8' if self.fp8 else self.dtype or 'any dtype'} ones")

    def update_weights(self, weights: Weights, version: int) -> None:
        """Push the HF-layout weights (a full dict, or a stream of buckets taken one at a time) to every engine
        (starting launched ones the first time, from a disk export); rollouts after this carry `version`."""
        self._ready_for_update()
        state = engine_weights(weights, fp8=self.fp8, dtype=self.dtype)
        del weights
        if self.pool.needs_launch:
            self.pool.launch_all(self._export(state, version), version)
            self.weight_version = version
            return
        transport = self.transports[self.weight_sync]
        self.pool.update(version, lambda targets: transport.send(state, version, targets),
                         session=transport.needs_session)

    # -- generation ---------------------------------------------------------------------------------------------
    sample_seeds = staticmethod(sample_seeds)

    @staticmethod
    def _request(prompt: list[int], params: SamplingParams, seeds: list[int] | None,
                 rows: tuple[int, ...] | None = None) -> dict:
        """The /generate body for samples `rows` of one prompt (wire.generate_request)."""
        return generate_request(prompt, params, seeds, rows)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RolloutSample]:
        """params.n samples per prompt, prompt by prompt, each validated against the last pushed weight version."""
        if self.weight_version < 0:
            raise RuntimeError("generate: no weights pushed yet (call update_weights first)")
        if params.truncated and not self._warned_truncation:
            log.warning("rollout with top_p=%s top_k=%s: SGLang returns log-probs of the untruncated distribution, "
                        "which the masks assume, but samples from the truncated one: ratios and masks are biased",
                        params.top_p, params.top_k)
            self._warned_truncation = True
        samples = self.pool.generate(prompts, params, self._parser(prompts, params, self._routed(params)))
        seeds = [sample_seeds(params, i) for i in range(len(prompts))]
        for k, s in enumerate(samples):  # the seed each sample was drawn with, for its extension
            s.seed = None if params.seed is None else seeds[k // params.n][k % params.n]
        return samples

    def _routed(self, params: SamplingParams) -> tuple[int, int, int] | None:
        """(layers, top_k, experts) of the routed experts asked for, None when not asked."""
        if not params.return_routed_experts:
            return None
        m = self.model_config
        if not m.is_moe:
            raise ValueError("sampling.return_routed_experts: the model has no MoE layers")
        return m.num_layers, m.moe_router_topk, m.num_experts

    def _parser(self, prompts, params: SamplingParams, routed):
        def parse(out: dict, i: int) -> RolloutSample:
            return parse_generate_output(out, prompt_index=i, prompt_ids=prompts[i], k=params.top_k_logprobs,
                                         vocab_size=self.vocab_size, weight_version=self.weight_version,
                                         routed_experts=routed, partial=params.partial)
        return parse

    def extend(self, samples: list[RolloutSample], params: SamplingParams) -> list[RolloutSample]:
        """Each unfinished sample continued by a /generate of prompt + response so far with its own sampling seed
        and the tokens left, appended to it (`RolloutSample.continued`). `megatron-pdm serve`, and SGLang with
        --enable-deterministic-inference, key seeded sampling on the seed and the position, so that the
        continuation draws what an uncut generation would; other SGLang servers draw anew."""
        todo = [k for k, s in enumerate(samples)
                if s.finish_reason != "stop" and len(s.response_ids) < params.max_new_tokens]
        inputs = [samples[k].prompt_ids + samples[k].response_ids.tolist() for k in todo]
        one = replace(params, n=1, seed=None)
        seeds = [[samples[k].seed if samples[k].seed is not None else int(torch.randint(0, 2**62, ()))]
                 for k in todo]
        more = self.pool.generate(inputs, one, self._parser(inputs, one, self._routed(params)), seeds=seeds,
                                  budgets=[params.max_new_tokens - len(samples[k].response_ids) for k in todo])
        out = list(samples)
        for k, m, (seed,) in zip(todo, more, seeds, strict=True):
            m.prompt_index = samples[k].prompt_index
            out[k] = replace(samples[k], seed=seed).continued(m)
        return out

    # -- teacher scoring ----------------------------------------------------------------------------------------
    def score(self, sequences: list[list[int]], starts: list[int], top_k: int) -> list[TeacherScores]:
        """The teacher's top-K on positions [starts[i], len(sequences[i])) of every sequence: one prefill-only
        /generate each (`wire.score_request`: max_new_tokens 0, logprob_start_len start - 1), all in flight at once
        over the engines (straight to them, past a router) and re-sent on failure or abort as generate's
        (`WorkerPool.generate`). The weights are the engines' own (a teacher is never updated by the trainer), so
        no weight version is checked."""
        check_score_inputs(sequences, starts, top_k, self.vocab_size)
        if not sequences:
            return []
        params = SamplingParams(max_new_tokens=1, top_k_logprobs=top_k)  # timeout: rollout.timeout_s + 1 token's

        def parse(out: dict, i: int) -> TeacherScores:
            return parse_score_output(out, index=i, sequence=sequences[i], start=starts[i], k=top_k,
                                      vocab_size=self.vocab_size)

        return self.pool.generate(sequences, params, parse,
                                  bodies=[score_request(s, a, top_k) for s, a in zip(sequences, starts, strict=True)])
