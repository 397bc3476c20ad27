"""`RolloutConfig` (the config's `rollout` section), beside the engines that consume it: what generates the
rollouts, how, and on which schedule. `build_engine` (factory.py) turns it into a `RolloutEngine`, and
`launch_spec` into the servers an engine launches."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_pdm._rundir import RunDir
from megatron_pdm._userfn import load_function
from megatron_pdm._validate import check_bool, check_choice, check_finite, check_int, check_number, check_one_line
from megatron_pdm.models.hf import DEFAULT_BUCKET_BYTES

from .sglang.launcher import SERVERS, LaunchSpec, cpu_sglang
from .sglang.transports import WEIGHT_SYNCS

log = logging.getLogger(__name__)
ENGINES = ("embedded", "sglang")
OVERLONG_RESPONSES = ("keep", "mask", "penalty")
SCHEDULES = ("sync", "lagged", "streaming")


def default_segment_tokens(max_new_tokens: int) -> int:
    """rollout.segment_tokens when not given: half of max_new_tokens, rounded up."""
    return -(-max_new_tokens // 2)


@dataclass(frozen=True)
class RolloutConfig:
    """engine embedded (an in-process inference copy) or sglang: the SGLang workers at `urls`, or `num_engines`
    that the trainer launches itself (`server` sglang, or megatron-pdm for `megatron-pdm serve` on a CPU), of
    `engine_tp` GPUs each, with `server_args` passed through. `router` puts sglang-router in front of them when it
    is installed (else round-robin). `weight_sync` disk (HF exports under `weight_dir`, default <run dir>/weights,
    each pipeline stage writing its own shards: one file system for every trainer node and the engines),
    distributed (bucketed broadcasts, engines on other nodes; one group per pipeline stage) or tensor (colocated
    engines). `routed_experts`
    asks MoE engines for the experts they routed every token to and replays them in the trainer (R3).
    top_p / top_k other than 1 / -1 truncate sampling, which the masks do not model: allowed, with a warning.
    `megatron-pdm submit` fills `urls` with the engines it starts, so a cluster config may leave them empty."""

    engine: str = "embedded"
    urls: tuple[str, ...] = ()
    num_engines: int = 0
    server: str = "sglang"
    engine_tp: int = 1
    server_args: tuple[str, ...] = ()
    router: bool = False
    weight_sync: str = "disk"
    weight_dir: str | None = None
    # the weight sync's bucket: each pipeline stage's sender holds at most one (train/weight_sync.py)
    sync_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    routed_experts: bool = False
    # the interpreter that runs SGLang engines (launched here or by the Slurm job): a virtualenv or image of their
    # own, as sglang 0.5.23 pins torch / transformers versions the trainer's constraints exclude (`make engine-env`);
    # None: the trainer's own (`python` inside a container)
    engine_python: str | None = None
    n: int = 8
    # the sampling temperature T of mu, and the T of the trainer's pi = softmax(z / T): the run's one temperature
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 4
    release_memory: bool = False  # sglang engines colocated with training: free their memory while it trains
    # per request; a /generate may take timeout_s + max_new_tokens / tokens_per_s (the slowest per-sequence decode,
    # queueing included, a healthy engine keeps); a weight update (sent once, never re-sent) update_timeout_s
    timeout_s: float = 300.0
    tokens_per_s: float = 5.0
    update_timeout_s: float = 1800.0
    # responses cut at max_new_tokens: keep them, mask them out of the loss, or add DAPO's soft overlong penalty
    # (0 up to max_new_tokens - overlong_buffer tokens, then linearly down to -overlong_penalty_factor)
    overlong: str = "keep"
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0
    retries: int = 2
    max_restarts: int = 2
    # which weights generate each step's rollouts (train/schedule.py): sync, the weights of the step that trains on
    # them; lagged, those of `lag` steps before (1: one-step-off); streaming, groups admitted up to `max_staleness`
    # versions ahead of the trainer and generated `segment_tokens` per sample per step, a sample cut by a weight
    # update continued under the new weights (`partial`; false: every sample generated whole in one step). Produced
    # while the trainer trains when `overlap` (false: the same rollouts, produced after each step instead)
    schedule: str = "sync"
    lag: int = 1
    max_staleness: int = 1
    partial: bool = True
    segment_tokens: int | None = None  # None: half of max_new_tokens, rounded up
    overlap: bool = True
    # multi-turn rollouts (rollout/multi_turn.py), a `module:function` / `file.py:function` either way: tool_fn, the
    # environment's reply after each turn of the policy, fn(sample, problem, ctx) -> token ids or None (every
    # schedule); or generate_fn, whole responses in place of engine.generate, fn(engine, prompts, params, ctx) ->
    # samples (sync, lagged); and the most policy turns per response
    tool_fn: str | None = None
    generate_fn: str | None = None
    max_turns: int = 1

    def __post_init__(self):
        check_finite("rollout", self)
        check_choice("rollout.engine", self.engine, ENGINES)
        check_choice("rollout.server", self.server, SERVERS)
        check_choice("rollout.weight_sync", self.weight_sync, WEIGHT_SYNCS)
        object.__setattr__(self, "urls", tuple(self.urls))
        object.__setattr__(self, "server_args", tuple(str(a) for a in self.server_args))
        check_int("rollout.n", self.n)
        check_number("rollout.temperature", self.temperature, lo=0.0, lo_open=True)
        check_int("rollout.max_new_tokens", self.max_new_tokens)
        check_int("rollout.num_engines", self.num_engines, lo=0)
        check_int("rollout.engine_tp", self.engine_tp)
        check_int("rollout.retries", self.retries, lo=0)
        check_int("rollout.max_restarts", self.max_restarts, lo=0)
        check_int("rollout.sync_bucket_bytes", self.sync_bucket_bytes)
        for name in ("timeout_s", "tokens_per_s", "update_timeout_s"):
            check_number(f"rollout.{name}", getattr(self, name), lo=0.0, lo_open=True)
        check_number("rollout.top_p", self.top_p, lo=0.0, hi=1, lo_open=True)
        check_int("rollout.top_k", self.top_k, special=-1, special_note="no truncation")
        for name in ("release_memory", "router", "routed_experts"):
            check_bool(f"rollout.{name}", getattr(self, name))
        if self.engine != "sglang":
            for name, default in (("release_memory", False), ("router", False), ("num_engines", 0), ("urls", ())):
                if getattr(self, name) != default:
                    raise ValueError(f"rollout.{name}: {getattr(self, name)!r} applies to the sglang engine only "
                                     f"(rollout.engine is {self.engine!r})")
        if self.engine_python is not None:
            check_one_line("rollout.engine_python", self.engine_python)
        check_choice("rollout.overlong", self.overlong, OVERLONG_RESPONSES)
        check_choice("rollout.schedule", self.schedule, SCHEDULES)
        check_int("rollout.lag", self.lag, lo=0)
        check_int("rollout.max_staleness", self.max_staleness, lo=0)
        for name in ("overlap", "partial"):
            check_bool(f"rollout.{name}", getattr(self, name))
        if self.segment_tokens is None:
            object.__setattr__(self, "segment_tokens", default_segment_tokens(self.max_new_tokens))
        check_int("rollout.segment_tokens", self.segment_tokens)
        if self.release_memory and self.engine == "sglang" and self.server == "sglang" and cpu_sglang(self.server_args):
            raise ValueError("rollout.release_memory: true with SGLang engines on a CPU (rollout.server_args --device "
                             "cpu, or SGLANG_USE_CPU_ENGINE=1): /release_memory_occupation kills a CPU SGLang server "
                             "(0.5.23 synchronizes a CUDA device there); set it false")
        if (self.schedule == "streaming" or (self.schedule == "lagged" and self.lag)) and self.release_memory:
            raise ValueError(f"rollout.schedule: {self.schedule!r} generates between the weight updates, while the "
                             "trainer holds the GPUs, which colocated engines cannot (rollout.release_memory: true "
                             "frees their memory until the next update); use schedule 'sync', or engines on GPUs "
                             "of their own")
        check_int("rollout.max_turns", self.max_turns)
        for name in ("tool_fn", "generate_fn"):
            if getattr(self, name) is not None:  # a module that does not import fails here, at load
                load_function(getattr(self, name), f"rollout.{name}")
        if self.tool_fn is not None and self.generate_fn is not None:
            raise ValueError(f"rollout.tool_fn: {self.tool_fn!r} with rollout.generate_fn {self.generate_fn!r}: the "
                             "built-in multi-turn loop calls the tool, a generate_fn runs its own; give one")
        if self.generate_fn is not None and self.schedule == "streaming":
            raise ValueError(f"rollout.generate_fn: {self.generate_fn!r} generates whole responses, and "
                             "rollout.schedule 'streaming' generates them a segment per step; use 'sync' or 'lagged', "
                             "or rollout.tool_fn, which streaming calls after each turn")
        if self.max_turns != 1 and self.tool_fn is None and self.generate_fn is None:
            raise ValueError(f"rollout.max_turns: {self.max_turns} turns need rollout.tool_fn (or generate_fn), the "
                             "function that gives the environment's turns between them")
        check_int("rollout.overlong_buffer", self.overlong_buffer, lo=0)
        check_number("rollout.overlong_penalty_factor", self.overlong_penalty_factor, lo=0.0)
        if self.overlong == "penalty" and not 0 < self.overlong_buffer <= self.max_new_tokens:
            raise ValueError(f"rollout.overlong_buffer: {self.overlong_buffer} must be in [1, rollout.max_new_tokens "
                             f"= {self.max_new_tokens}] with rollout.overlong 'penalty'")
        if self.urls and self.num_engines:
            raise ValueError(f"rollout.num_engines: {self.num_engines} with rollout.urls {list(self.urls)}: attach "
                             "to given workers or launch engines, not both")
        if self.top_p != 1 or self.top_k != -1:
            log.warning("rollout.top_p=%s, rollout.top_k=%s: truncated sampling; the masks and importance ratios "
                        "assume the untruncated distribution mu = softmax(logits / T), which these samples do not "
                        "follow", self.top_p, self.top_k)

    def launch_spec(self, *, dtype: str, kv_cache_dtype: str, run_dir) -> LaunchSpec | None:
        """The servers this config launches (None when it attaches to `urls` or embeds the engine): `num_engines` of
        `engine_tp` GPUs in the rollout dtype and KV-cache dtype of the precision section, logging under
        <run dir>/logs. No online quantization: SGLang takes no weight updates into an engine that quantizes its
        own checkpoint, so FP8 engines start from block-FP8 weights (fp8_export.py) and are sent block-FP8 ones."""
        if self.engine != "sglang" or not self.num_engines:
            return None
        return LaunchSpec(server=self.server, num_engines=self.num_engines, tp=self.engine_tp, dtype=dtype,
                          quantization=None, kv_cache_dtype=kv_cache_dtype, server_args=self.server_args,
                          routed_experts=self.routed_experts,
                          memory_saver=self.release_memory and self.server == "sglang", log_dir=RunDir(run_dir).logs,
                          python=self.engine_python or sys.executable)

    def export_dir(self, run_dir) -> Path:
        """Where disk weight syncs export: `weight_dir`, by default <run dir>/weights."""
        return Path(self.weight_dir) if self.weight_dir else RunDir(run_dir).weights
