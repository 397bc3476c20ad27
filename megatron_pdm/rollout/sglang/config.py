"""`SGLangConfig`: the `rollout.sglang` sub-section, the settings of the SGLang engine alone (where its workers are
or how many it launches, how requests and weight updates reach them). The generic rollout settings (sampling,
schedule, multi-turn) stay in `RolloutConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pdm._validate import check_bool, check_choice, check_finite, check_int, check_number, check_one_line

from .launcher import SERVERS
from .transports import WEIGHT_SYNCS

SECTION = "rollout.sglang"


@dataclass(frozen=True)
class SGLangConfig:
    """The SGLang workers at `urls`, or `num_engines` that the trainer launches itself (`server` sglang, or
    megatron-pdm for `megatron-pdm serve` on a CPU), of `engine_tp` GPUs each, with `server_args` passed through.
    `router` puts sglang-router in front of them when it is installed (else round-robin). `weight_sync` disk (HF
    exports under `weight_dir`, default <run dir>/weights, each pipeline stage writing its own shards: one file
    system for every trainer node and the engines), distributed (bucketed broadcasts, engines on other nodes; one
    group per pipeline stage) or tensor (colocated engines). `megatron-pdm submit` fills `urls` with the engines it
    starts, so a cluster config may leave them empty."""

    urls: tuple[str, ...] = ()
    num_engines: int = 0
    server: str = "sglang"
    engine_tp: int = 1
    server_args: tuple[str, ...] = ()
    router: bool = False
    weight_sync: str = "disk"
    weight_dir: str | None = None  # weight_sync disk: where the HF exports go (None: <run dir>/weights)
    # the interpreter that runs SGLang engines (launched here or by the Slurm job): a virtualenv or image of their
    # own, as sglang 0.5.23 pins torch / transformers versions the trainer's constraints exclude (`make engine-env`);
    # None: the trainer's own (`python` inside a container)
    engine_python: str | None = None  # the engines' interpreter (see above; None: the trainer's own)
    release_memory: bool = False  # engines colocated with training: free their memory while it trains
    # per request; a /generate may take timeout_s + max_new_tokens / tokens_per_s (the slowest per-sequence decode,
    # queueing included, a healthy engine keeps); a weight update (sent once, never re-sent) update_timeout_s
    timeout_s: float = 300.0
    tokens_per_s: float = 5.0  # the slowest decode rate a healthy engine keeps (a /generate's deadline grows by it)
    update_timeout_s: float = 1800.0  # seconds a weight update may take (sent once, never re-sent)
    retries: int = 2  # times a failed request is retried, with exponential backoff
    max_restarts: int = 2  # times a launched engine that keeps failing is restarted (then dropped)

    def __post_init__(self):
        check_finite(SECTION, self)
        check_choice(f"{SECTION}.server", self.server, SERVERS)
        check_choice(f"{SECTION}.weight_sync", self.weight_sync, WEIGHT_SYNCS)
        object.__setattr__(self, "urls", tuple(self.urls))
        object.__setattr__(self, "server_args", tuple(str(a) for a in self.server_args))
        check_int(f"{SECTION}.num_engines", self.num_engines, lo=0)
        check_int(f"{SECTION}.engine_tp", self.engine_tp)
        check_int(f"{SECTION}.retries", self.retries, lo=0)
        check_int(f"{SECTION}.max_restarts", self.max_restarts, lo=0)
        for name in ("timeout_s", "tokens_per_s", "update_timeout_s"):
            check_number(f"{SECTION}.{name}", getattr(self, name), lo=0.0, lo_open=True)
        for name in ("release_memory", "router"):
            check_bool(f"{SECTION}.{name}", getattr(self, name))
        if self.engine_python is not None:
            check_one_line(f"{SECTION}.engine_python", self.engine_python)
        if self.urls and self.num_engines:
            raise ValueError(f"{SECTION}.num_engines: {self.num_engines} with {SECTION}.urls {list(self.urls)}: "
                             "attach to given workers or launch engines, not both")
