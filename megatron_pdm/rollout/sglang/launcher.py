"""Starting rollout servers and the router as child processes of the trainer.

`server` "sglang" runs `python -m sglang.launch_server` (one engine per `tp` GPUs, `--base-gpu-id` apart);
"megatron-pdm" runs `megatron-pdm serve`, the embedded engine behind the same HTTP API, which is what a CPU
machine can run. Each engine logs to <log_dir>/engine-<i>.log and can be restarted on the same port.

`sglang_args` renders SGLang's command line (all but where the engine runs) for both the engines launched here
and those the Slurm script starts (`megatron-pdm submit`, slurm/engines.sh adds --tp-size, --base-gpu-id, the
multi-node flags, --host and --port). The trainer sends token ids and decodes the responses itself, so an
engine whose checkpoint directory has no tokenizer files starts with --skip-tokenizer-init (SGLang would fail
to load a tokenizer there); with the files (the exports copy the trainer's) SGLang loads them and also returns
`text`, which nothing here reads.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from megatron_pdm._validate import check_int
from megatron_pdm.models import ModelConfig

from .health import is_healthy, wait_healthy

log = logging.getLogger(__name__)
SERVERS = ("sglang", "megatron-pdm")
# what a launched engine must not inherit from a trainer run by torchrun (or by the Slurm script's one task per
# rank): with TORCHELASTIC_USE_AGENT_STORE set, SGLang's own init_process_group takes torch's agent-store branch,
# where every rank is a client of a store nobody serves, and the engine never becomes healthy
RANK_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                            "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                            "MEGATRON_PDM_SLURM_RANKS"})


def engine_environment(env=None, *, own_python: bool = False) -> dict[str, str]:
    """This process's environment (or `env`) without torchrun's and the job's rank variables (RANK_VARIABLES,
    TORCHELASTIC_*): what a launched engine or router starts with. own_python: the engine runs an interpreter of its
    own (rollout.sglang.engine_python), which must not import the trainer's packages either (PYTHONPATH,
    VIRTUAL_ENV)."""
    env = os.environ if env is None else env
    drop = RANK_VARIABLES | ({"PYTHONPATH", "VIRTUAL_ENV"} if own_python else set())
    return {k: v for k, v in env.items() if k not in drop and not k.startswith("TORCHELASTIC_")}


def sglang_args(model_path: str, *, dtype: str, quantization: str | None = None, kv_cache_dtype: str = "auto",
                routed_experts: bool = False, memory_saver: bool = False, mem_fraction_static: float | None = None,
                weight_version: int | None = None, skip_tokenizer_init: bool | None = None,
                server_args=(), python: str = sys.executable) -> list[str]:
    """`python -m sglang.launch_server` and every flag but the placement (--tp-size, --base-gpu-id, --nnodes,
    --node-rank, --dist-init-addr, --host, --port). skip_tokenizer_init None: when model_path has no tokenizer
    files (checked now: the directory must exist where this runs, else the flag is passed)."""
    from megatron_pdm.models.tokenizer import has_tokenizer

    if skip_tokenizer_init is None:
        skip_tokenizer_init = not has_tokenizer(model_path)
    # no --trust-remote-code: it would run the Python a checkpoint's config.json names (auto_map) in every engine;
    # a checkpoint that needs it (Kimi-K2's tokenizer) asks for it in rollout.sglang.server_args
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--dtype", dtype,
           "--skip-server-warmup"]
    if weight_version is not None:
        cmd += ["--weight-version", str(weight_version)]
    if quantization:
        cmd += ["--quantization", quantization]
    if kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", kv_cache_dtype]
    if skip_tokenizer_init:
        cmd += ["--skip-tokenizer-init"]
    if routed_experts:
        cmd += ["--enable-return-routed-experts"]
    if mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", f"{mem_fraction_static:.2f}"]
    if memory_saver:
        cmd += ["--enable-memory-saver"]
    return cmd + [str(a) for a in server_args]


def serve_args(model_path: str, *, dtype: str, quantization: str | None = None, weight_version: int | None = None,
               python: str = sys.executable) -> list[str]:
    """`megatron-pdm serve` (the embedded engine behind SGLang's API, what a CPU runs) and every flag but where it
    listens (--host, --port): the same renderer for the engines launched here and those `submit` starts."""
    cmd = [python, "-m", "megatron_pdm.cli", "serve", "--model-path", str(model_path), "--dtype", dtype]
    if weight_version is not None:
        cmd += ["--weight-version", str(weight_version)]
    return cmd + (["--quantization", quantization] if quantization else [])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LaunchSpec:
    """How to start `num_engines` rollout servers on this node. dtype / quantization / kv_cache_dtype as SGLang's
    flags; server_args are passed through to every server; routed_experts starts SGLang with
    --enable-return-routed-experts; memory_saver with --enable-memory-saver (colocated engines release memory)."""

    server: str = "sglang"
    num_engines: int = 1
    tp: int = 1
    host: str = "127.0.0.1"
    dtype: str = "bfloat16"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    server_args: tuple[str, ...] = ()
    routed_experts: bool = False
    memory_saver: bool = False
    startup_timeout_s: float = 900.0
    log_dir: Path = field(default_factory=lambda: Path("."))
    # the SGLang engines' interpreter (rollout.sglang.engine_python): an environment of their own
    python: str = sys.executable

    def __post_init__(self):
        if self.server not in SERVERS:
            raise ValueError(f"rollout.sglang.server: {self.server!r} is not one of {', '.join(SERVERS)}")
        for name in ("num_engines", "tp"):
            check_int(f"rollout.{name}", getattr(self, name))
        if self.server == "megatron-pdm" and self.tp != 1:
            raise ValueError(f"rollout.sglang.engine_tp: {self.tp}: megatron-pdm serve runs one process per engine "
                             "(tp 1)")

    def command(self, index: int, model_path: str, port: int, weight_version: int) -> list[str]:
        if self.server == "megatron-pdm":
            return serve_args(model_path, dtype=self.dtype, quantization=self.quantization,
                              weight_version=weight_version) + ["--host", self.host, "--port", str(port),
                                                                *self.server_args]
        import torch

        gpus = max(1, torch.cuda.device_count())  # more engines than GPUs: they share (set mem-fraction-static)
        cmd = sglang_args(model_path, dtype=self.dtype, quantization=self.quantization,
                          kv_cache_dtype=self.kv_cache_dtype, routed_experts=self.routed_experts,
                          memory_saver=self.memory_saver, weight_version=weight_version, python=self.python)
        placement = ["--tp-size", str(self.tp), "--base-gpu-id", str(index * self.tp % gpus), "--host", self.host,
                     "--port", str(port)]
        return cmd + placement + list(self.server_args)


class EngineProcess:
    """One launched server on a fixed port; `start` (re)starts it from an HF checkpoint at a weight version."""

    def __init__(self, spec: LaunchSpec, index: int, port: int | None = None):
        self.spec, self.index = spec, index
        self.port = port or free_port(spec.host)
        self.url = f"http://{spec.host}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, model_path: str, weight_version: int) -> None:
        self.stop()
        path = Path(self.spec.log_dir) / f"engine-{self.index}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as logf:
            logf.write(f"--- start {self.starts}: {model_path} (weight version {weight_version})\n")
            logf.flush()
            self.proc = subprocess.Popen(self.spec.command(self.index, model_path, self.port, weight_version),
                                         stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=engine_environment(own_python=self.spec.server == "sglang"
                                                                and self.spec.python != sys.executable))
        self.starts += 1

    def wait_ready(self) -> None:
        wait_healthy([self.url], deadline_s=self.spec.startup_timeout_s, pid=self.proc.pid, poll_s=0.2)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def router_available() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


class Router:
    """sglang-router in front of the engines (round robin); engines are added and removed as they restart. A
    start-up that fails in any way (no health in time, /workers unreachable or malformed, SIGTERM's SystemExit)
    kills the router's process: in a session of its own, it would outlive the trainer with its port."""

    def __init__(self, urls: list[str], *, host: str = "127.0.0.1", log_dir: Path = Path("."),
                 startup_timeout_s: float = 60.0):
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(log_dir) / "router.log", "a") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(self.port),
                 "--prometheus-port", str(free_port(host)), "--policy", "round_robin", "--worker-urls", *urls],
                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, env=engine_environment())
        try:
            wait_healthy([self.url], deadline_s=startup_timeout_s, pid=self.proc.pid, poll_s=0.2)
            self._wait_workers(len(urls), startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def running(self) -> bool:
        return self.proc.poll() is None and is_healthy(self.url)

    def workers(self) -> dict[str, str]:
        """url -> the router's worker id, for the healthy workers it routes to."""
        import json

        with urllib.request.urlopen(self.url + "/workers", timeout=10) as r:
            return {w["url"]: w["id"] for w in json.loads(r.read())["workers"]}

    def _wait_workers(self, count: int, deadline_s: float, present: str | None = None) -> None:
        end = time.monotonic() + deadline_s
        while len(self.workers()) < count or (present is not None and present not in self.workers()):
            if time.monotonic() > end:
                raise TimeoutError(f"router {self.url}: {count} workers not registered after {deadline_s:.0f} s")
            time.sleep(0.1)

    def add(self, url: str) -> None:
        if url in self.workers():
            return
        import json

        req = urllib.request.Request(self.url + "/workers", data=json.dumps({"url": url}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).read()
        self._wait_workers(0, 30.0, present=url)  # the router adds workers in the background

    def remove(self, url: str) -> None:
        wid = self.workers().get(url)
        if wid is None:
            return
        try:
            urllib.request.urlopen(urllib.request.Request(f"{self.url}/workers/{wid}", method="DELETE"),
                                   timeout=10).read()
        except urllib.error.URLError as e:
            log.warning("router: removing %s failed (%s)", url, e)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# -- what SGLang can shard --------------------------------------------------------------------------------------
def _server_arg(args: tuple[str, ...], *names: str) -> str | None:
    """The value of the last of `names` in an SGLang command line (`--flag value` or `--flag=value`), or None."""
    value = None
    for i, a in enumerate(args):
        key, eq, v = a.partition("=")
        if key in names:
            value = v if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def cpu_sglang(args: tuple[str, ...], env=None) -> bool:
    """Whether SGLang engines started with the command line `args` run on a CPU: `--device cpu`, or
    SGLANG_USE_CPU_ENGINE=1 (what selects SGLang 0.5.23's CPU platform) in the environment (`env`, default this
    process's) that they inherit."""
    env = os.environ if env is None else env
    return _server_arg(tuple(args), "--device") == "cpu" or env.get("SGLANG_USE_CPU_ENGINE") == "1"


def attention_dp(args: tuple[str, ...], tp: int, field: str) -> int:
    """`attention_dp_size` of an SGLang command line `args` for engines of `tp` GPUs (`field` names the TP)."""
    if "--enable-dp-attention" not in args:
        return 1
    value = _server_arg(args, "--dp-size", "--dp", "--data-parallel-size")
    if value is None or not value.isdigit() or int(value) < 1 or tp % int(value):
        raise ValueError(f"rollout.sglang.server_args: --enable-dp-attention needs --dp-size, a divisor of {field} "
                         f"{tp}; got {value!r}")
    return int(value)


def engine_head_error(m: ModelConfig, attention_tp: int) -> str | None:
    """None when SGLang can shard `m`'s attention over `attention_tp` GPUs; else why not. SGLang's attention layers
    (Qwen3's, DeepSeek's MLA) split the query heads over the attention TP, so it must divide
    model.num_attention_heads, and the KV heads (model.num_query_groups) too where there are at least as many of
    them, else it replicates them: then the TP must be a multiple of them. (An MLA model has as many KV heads as
    query heads in megatron's config, so only the first rule can fail: SGLang caches its latent whole on every
    GPU.)"""
    n, g, tp = m.num_attention_heads, m.num_query_groups, attention_tp
    if n % tp:
        return f"does not divide model.num_attention_heads = {n}: SGLang shards the query heads over its TP"
    if g % tp and tp % g:
        return (f"and model.num_query_groups = {g} KV heads do not divide each other: SGLang splits the KV heads "
                "over its TP, or replicates them over a TP that is a multiple of them")
    return None


def check_engine_heads(m: ModelConfig, tp: int, *, field: str, server_args: tuple[str, ...] = ()) -> None:
    """ValueError naming `field`, its value and the heads when SGLang engines of `tp` GPUs cannot shard `m`'s
    attention (`engine_head_error`); with DP attention (rollout.sglang.server_args --enable-dp-attention --dp-size dp)
    the attention runs over tp / dp GPUs."""
    dp = attention_dp(server_args, tp, field)
    error = engine_head_error(m, tp // dp)
    if error is None:
        return
    good = [t for t in range(1, m.num_attention_heads + 1) if engine_head_error(m, t) is None]
    what = f"{field}: {tp}" + (f" / DP-attention --dp-size {dp} = attention TP {tp // dp}" if dp > 1 else "")
    kind = "attention" if dp > 1 else "engine"
    raise ValueError(f"{what} {error} ({kind} TPs that work: {', '.join(map(str, good))})")
