"""The run configuration: typed dataclasses loaded from YAML, validated on load, with `key.sub=value` overrides."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from megatron_pdm._dataclass import from_dict
from megatron_pdm._validate import check_bool, check_choice, check_finite, check_int, check_number, check_one_line
from megatron_pdm.models import ModelConfig, ParallelConfig, layout_of, moe_kernel_problem
from megatron_pdm.models.hf import NOT_ARCHITECTURE, architecture_mismatches, model_config_from_hf
from megatron_pdm.objectives import ObjectiveConfig
from megatron_pdm.precision import PrecisionConfig
from megatron_pdm.rollout.config import RolloutConfig, default_segment_tokens
from megatron_pdm.rollout.engines import ENGINES, engine_spec
from megatron_pdm.vocab_parallel import EXACT_KINDS, TOPK_KINDS

log = logging.getLogger(__name__)
TASKS = ("arithmetic", "dataset")
OVERLONG = ("error", "skip")
FILTER_GROUPS = ("none", "zero_variance")
INITS = ("random", "hf")
RECOMPUTE = ("none", "full")
CLUSTER_GPUS = ("h100", "h200", "b200", "cpu")
WANDB_MODES = ("online", "offline")


@dataclass(frozen=True)
class DataConfig:
    """task arithmetic: built-in addition problems with operands in [0, max_operand], worded by arithmetic_prompt
    (default `a+b=`; e.g. "What is {a} + {b}?" for an instruct model's chat template); dataset (the default when
    train_path is given): records from JSONL or Parquet files, the prompt and the answer at the dotted paths
    prompt_key / answer_key (verl's layout: `prompt` a list of {role, content} messages, the answer at
    `reward_model.ground_truth`). eval_paths: evaluation sets, a list of files (named by their stem) or a mapping
    name -> file, each logged as eval/<name>/reward (without them: held-out arithmetic problems, or the first
    train.eval_prompts training records). chat_template: render every prompt with the tokenizer's template
    (a string prompt is one user message; system_prompt first unless a prompt has its own); chat_template_kwargs
    go to the template (Qwen3's enable_thinking). warm_start_key: the warm start's target (train.warm_start_steps),
    a text or a list of turns (a multi-turn demonstration: assistant turns are learned, the others are context).
    reward: exact_number (the first number), last_number (the last: a chatty model restates the operands first),
    math_verify, a user function
    `package.module:function` / `file.py:function` (response, answer, metadata) -> float (a bool counts as 1 / 0),
    or a server `http(s)://host:port/path` (train/remote_reward.py: a POST per sample, reward_concurrency in flight,
    reward_retries retries with capped exponential backoff, reward_timeout_s per request).
    A prompt longer than max_prompt_length tokens is an error (overlong_prompt error) or dropped and counted
    (skip)."""

    task: str | None = None  # arithmetic or dataset (None: dataset when train_path is set, else arithmetic)
    max_operand: int = 9  # the arithmetic task's operands are drawn from [0, max_operand]
    arithmetic_prompt: str = "{a}+{b}="  # the arithmetic task's prompt text, with the operands as {a} and {b}
    train_path: str | None = None  # the training set, a .jsonl or .parquet file (task dataset)
    # evaluation sets: a list of files (named by their stem) or a mapping name -> file; empty: held-out problems
    eval_paths: tuple[str, ...] | dict = ()
    prompt_key: str = "prompt"  # the dotted key of a record's prompt (a text or a list of {role, content} messages)
    answer_key: str = "answer"  # the dotted key of a record's answer (verl: reward_model.ground_truth)
    chat_template: bool = False  # render each prompt with the tokenizer's chat template (false: the raw text)
    system_prompt: str | None = None  # a system message put first (needs chat_template; a prompt's own wins)
    chat_template_kwargs: dict = field(default_factory=dict)  # extra template variables, e.g. enable_thinking: false
    # exact_number, last_number, math_verify, a function `module:function` / `file.py:function`, or an http(s) URL
    reward: str = "exact_number"
    reward_concurrency: int = 8  # a reward server's requests in flight at once
    reward_retries: int = 3  # a reward server's retries per sample, with capped exponential backoff
    reward_timeout_s: float = 30.0  # seconds per reward-server request
    max_prompt_length: int = 64  # the longest prompt, in tokens (the planner sizes sequences by it)
    overlong_prompt: str = "error"  # a prompt over max_prompt_length: an error, or skip (dropped and counted)
    # the warm start's target in each dataset record (dotted key; default: the answer): a text, or the turns after
    # the prompt as {role, content} messages (assistant turns learned, the others in the context only)
    warm_start_key: str | None = None

    def __post_init__(self):
        from .data import ARITHMETIC_PROMPT, check_arithmetic_prompt, load_reward
        from .remote_reward import check_url, is_remote

        check_finite("data", self)
        task = self.task or ("dataset" if self.train_path else "arithmetic")
        object.__setattr__(self, "task", task)
        check_choice("data.task", task, TASKS)
        check_int("data.max_operand", self.max_operand, lo=1)
        check_arithmetic_prompt(self.arithmetic_prompt)
        if self.arithmetic_prompt != ARITHMETIC_PROMPT and task != "arithmetic":
            raise ValueError(f"data.arithmetic_prompt: {self.arithmetic_prompt!r} words the arithmetic task; "
                             f"data.task is {task!r}")
        check_int("data.max_prompt_length", self.max_prompt_length)
        if task == "dataset" and not self.train_path:
            raise ValueError("data.train_path: required for task 'dataset' (a .jsonl or .parquet file)")
        check_choice("data.overlong_prompt", self.overlong_prompt, OVERLONG)
        if self.warm_start_key is not None and task != "dataset":
            raise ValueError(f"data.warm_start_key: {self.warm_start_key!r} reads dataset records; data.task is "
                             f"{task!r}")
        for name in ("prompt_key", "answer_key", "warm_start_key"):
            v = getattr(self, name)
            if v is None and name == "warm_start_key":
                continue
            if not isinstance(v, str) or not v or any(not part for part in v.split(".")):
                raise ValueError(f"data.{name}: expected a dotted key such as 'reward_model.ground_truth', got {v!r}")
        check_bool("data.chat_template", self.chat_template)
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ValueError(f"data.system_prompt: expected a string, got {self.system_prompt!r}")
        if self.system_prompt and not self.chat_template:
            raise ValueError("data.system_prompt: needs data.chat_template: true")
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(f"data.chat_template_kwargs: expected a mapping, got {self.chat_template_kwargs!r}")
        paths = self.eval_paths
        if isinstance(paths, str):
            paths = [paths]
        if not isinstance(paths, dict):
            names = [Path(str(p)).stem for p in paths]
            if len(set(names)) != len(names):
                raise ValueError(f"data.eval_paths: two files share a name in {list(paths)}; give a mapping "
                                 "name -> file")
            paths = dict(zip(names, paths, strict=True))
        for name, p in paths.items():
            if not isinstance(name, str) or not re.fullmatch(r"[\w.-]+", name) or not isinstance(p, str):
                raise ValueError(f"data.eval_paths: {name!r}: {p!r} (names are letters, digits, _ . -; files strings)")
        object.__setattr__(self, "eval_paths", dict(paths))
        if not isinstance(self.reward, str):
            raise ValueError(f"data.reward: expected a name, 'module:function' or a URL, got {self.reward!r}")
        check_int("data.reward_concurrency", self.reward_concurrency, lo=1)
        check_int("data.reward_retries", self.reward_retries, lo=0)
        check_number("data.reward_timeout_s", self.reward_timeout_s, lo=0.0, lo_open=True, finite=True)
        if is_remote(self.reward):
            check_url(self.reward)
        else:
            load_reward(self.reward)  # a module that does not import fails here, at load


@dataclass(frozen=True)
class OptimConfig:
    """megatron's Adam optimizer (AdamW: decoupled weight decay) for the RL steps; the warm start takes its own
    learning rate (train.warm_start_lr), and a fresh optimizer is made for RL after it."""

    lr: float = 1e-3  # Adam's learning rate for RL, constant (no schedule)
    weight_decay: float = 0.0  # Adam's decoupled weight decay (0: none)
    adam_beta1: float = 0.9  # Adam's first-moment decay
    adam_beta2: float = 0.999  # Adam's second-moment decay
    adam_eps: float = 1e-8  # Adam's denominator epsilon
    clip_grad: float = 1.0  # the global gradient-norm clip (0: no clipping)
    distributed_optimizer: bool = False  # shard Adam states and fp32 main parameters over data parallelism
    # the share of the (distributed) optimizer's fp32 main parameters and Adam states kept and stepped on the CPU
    # (megatron's optimizer_cpu_offload with optimizer_offload_fraction): 0 none, 1 (or true) all; needs
    # distributed_optimizer. `plan` moves that share from GPU to host memory.
    cpu_offload: float = 0.0

    def __post_init__(self):
        check_finite("optim", self)
        if isinstance(self.cpu_offload, bool):
            object.__setattr__(self, "cpu_offload", float(self.cpu_offload))
        check_number("optim.cpu_offload", self.cpu_offload, lo=0.0)
        if self.cpu_offload > 1:
            raise ValueError(f"optim.cpu_offload: {self.cpu_offload!r} must be a fraction in [0, 1] (or true / false)")
        if self.cpu_offload and not self.distributed_optimizer:
            raise ValueError(f"optim.cpu_offload: {self.cpu_offload!r} offloads the distributed optimizer's shards; "
                             "set optim.distributed_optimizer: true")
        check_number("optim.lr", self.lr, lo=0.0, lo_open=True)
        check_number("optim.weight_decay", self.weight_decay, lo=0.0)
        check_number("optim.clip_grad", self.clip_grad, lo=0.0)
        check_number("optim.adam_eps", self.adam_eps, lo=0.0, lo_open=True)
        check_bool("optim.distributed_optimizer", self.distributed_optimizer)
        for name in ("adam_beta1", "adam_beta2"):
            check_number(f"optim.{name}", getattr(self, name), lo=0.0, hi=1, hi_open=True)


@dataclass(frozen=True)
class TrainConfig:
    """steps: RL steps (one rollout batch each); prompts_per_step prompts x rollout.n samples per step, split
    into minibatches optimizer updates, each accumulated over micro-batches of micro_batch_size sequences.
    init: random (megatron's initialisation) or hf (init_path, an HF checkpoint directory); then
    warm_start_steps supervised steps on (prompt, answer) pairs (0 for none) before RL."""

    steps: int = 40  # RL steps, one rollout batch each (the run ends after this many)
    prompts_per_step: int = 16  # prompts per RL step, each sampled rollout.n times (a group)
    minibatches: int = 1  # optimizer updates per RL step: the step's samples split into this many
    micro_batch_size: int = 32  # sequences per micro-batch per rank (unused with max_tokens_per_microbatch)
    eval_every: int = 10  # evaluate every this many steps (and after the last)
    eval_prompts: int = 64  # prompts per evaluation set (the first of each)
    eval_samples: int = 4  # responses per eval prompt: eval/reward is avg@k, eval/pass@k beside it
    eval_temperature: float | None = None  # the sampling temperature at evaluation (None: rollout.temperature)
    eval_top_p: float = 1.0  # nucleus sampling's top_p at evaluation (1: off)
    checkpoint_every: int = 20  # save a checkpoint every this many steps (and after the last)
    keep_last: int = 2  # checkpoints kept; older ones are deleted
    # write checkpoints in a forked process (megatron's async dist_checkpointing) while training goes on; each is
    # published once every rank's writer has finished
    async_save: bool = False
    init: str = "random"  # the starting weights: random (megatron's initialisation) or hf (init_path)
    warm_start_steps: int = 40  # supervised steps on (prompt, answer) pairs before RL (0: none)
    warm_start_lr: float = 3e-3  # Adam's learning rate during the warm start
    init_path: str | None = None  # the HF checkpoint directory read with init hf
    seed: int = 1234  # seeds initialisation, the arithmetic problems, and each step's prompts and sampling
    recompute: str = "none"  # full: recompute each layer's activations in backward (megatron's full recompute)
    # token budgets: micro-batches of at most this many prompt + response tokens per rank, sequences packed by
    # length and DP ranks balanced by tokens (micro_batch_size is then unused); None: micro_batch_size rows
    max_tokens_per_microbatch: int | None = None
    # DAPO's dynamic sampling: drop groups whose rewards are all equal (no gradient); refill: sample more prompts
    # until prompts_per_step informative groups, up to max_rollout_rounds rollouts per step (then the step is
    # topped up with dropped groups, which add no gradient)
    filter_groups: str = "none"
    refill: bool = False  # sample more prompts until prompts_per_step informative groups (needs filter_groups)
    max_rollout_rounds: int = 4  # refill: at most this many rollouts per step
    # the output layer fused with the loss: the last stage returns hidden states and the loss multiplies them by the
    # output weight a chunk of rows at a time, so no [tokens, V/tp] logits tensor (nor its gradient) exists
    # (objectives.policy_loss_from_hidden); false: megatron's output layer, then the loss on its logits
    fused_output_layer: bool = True

    def __post_init__(self):
        check_finite("train", self)
        for name in ("steps", "prompts_per_step", "minibatches", "micro_batch_size", "eval_every", "eval_prompts",
                     "eval_samples", "checkpoint_every", "keep_last"):
            check_int(f"train.{name}", getattr(self, name))
        if self.eval_temperature is not None:
            check_number("train.eval_temperature", self.eval_temperature, lo=0.0, lo_open=True)
        check_number("train.eval_top_p", self.eval_top_p, lo=0.0, hi=1, lo_open=True)
        check_int("train.warm_start_steps", self.warm_start_steps, lo=0)
        check_number("train.warm_start_lr", self.warm_start_lr, lo=0.0, lo_open=True)
        check_int("train.seed", self.seed, lo=0)
        if self.max_tokens_per_microbatch is not None:
            check_int("train.max_tokens_per_microbatch", self.max_tokens_per_microbatch)
        check_choice("train.filter_groups", self.filter_groups, FILTER_GROUPS)
        check_bool("train.refill", self.refill)
        check_bool("train.async_save", self.async_save)
        check_bool("train.fused_output_layer", self.fused_output_layer)
        check_int("train.max_rollout_rounds", self.max_rollout_rounds)
        if self.refill and self.filter_groups == "none":
            raise ValueError("train.refill: true needs train.filter_groups: zero_variance")
        if self.filter_groups != "none" and not self.refill and self.max_tokens_per_microbatch is None:
            raise ValueError("train.filter_groups: dropping groups leaves a row count the fixed micro-batches "
                             "(micro_batch_size) may not divide; set train.max_tokens_per_microbatch (any count "
                             "packs) or train.refill: true (the step keeps prompts_per_step groups)")
        check_choice("train.recompute", self.recompute, RECOMPUTE)
        check_choice("train.init", self.init, INITS)
        if self.init == "hf" and not self.init_path:
            raise ValueError("train.init_path: required for init 'hf' (an HF checkpoint directory)")


# Slurm names as sites spell them (partition, account): letters, digits and `_ . -`, nothing a shell or sbatch's
# #SBATCH parser reads as syntax; a partition may be a comma-separated list (the job starts in whichever is first)
SLURM_NAME = re.compile(r"[A-Za-z0-9_.-]+")
SLURM_TIME = re.compile(r"([0-9]+-)?[0-9]+(:[0-9]+){0,2}")  # minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what `export NAME=...` takes: a shell identifier


def slurm_time_s(text: str) -> int:
    """A Slurm time (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; SLURM_TIME) in seconds."""
    days, _, rest = text.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:
        h, m, sec = (parts + [0, 0])[:3]
    else:
        h, m, sec = {1: [0, parts[0], 0], 2: [0, *parts], 3: parts}[len(parts)]
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + sec

# names cluster.env cannot set: the job script's own variables (slurm/train.sbatch, slurm/engines.sh and what submit
# renders into them; tests keep the list in step with the templates) and those that change how bash itself runs
SCRIPT_VARIABLES = frozenset({
    "CONFIG", "CONTAINER", "GPUS_PER_NODE", "GRID", "HEAD", "JOB_TAG", "LOG_DIR", "LOG_SUFFIX", "MASTER_ADDR",
    "MASTER_PORT", "NODES", "OVERRIDES", "POINT", "REQUEUE_FILE", "RESTART", "ROLLOUT_COUNT", "ROLLOUT_FIRST",
    "ROLLOUT_NODES", "ROLLOUT_NODE_LIST", "ROLLOUT_TP", "RUN_DIR", "STOP_FILE", "TRAIN_NODES", "TRAIN_PID",
    "WATCH_PID", "URLS", "ENGINES_PID", "HEALTH_PID", "ENGINE_CONTAINER", "STOP_REQUESTED",
    "IFS", "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "CDPATH", "GLOBIGNORE", "PROMPT_COMMAND"})


@dataclass(frozen=True)
class ClusterConfig:
    """Where `megatron-pdm submit` and `plan` put the job. gpu cpu: a CPU cluster, gpus_per_node processes per node
    and no GPU request. rollout_nodes 0: SGLang engines colocated on the training nodes; else that many nodes of
    their own (after the training nodes), one engine per rollout_tp GPUs. env: extra environment for every rank."""

    nodes: int = 1  # nodes the job asks for, training and rollout nodes together
    gpus_per_node: int = 8  # GPUs per node (gpu cpu: processes per node)
    gpu: str = "h100"  # the GPU model (plan's memory and speed figures); cpu: a CPU cluster, no GPU request
    rollout_nodes: int = 0  # nodes for the SGLang engines alone (0: colocated on the training nodes)
    rollout_tp: int = 1  # GPUs per SGLang engine (its tensor parallelism)
    partition: str | None = None  # Slurm --partition, several comma-separated (None: the cluster's default)
    account: str | None = None  # Slurm --account (None: the cluster's default)
    time: str = "04:00:00"  # Slurm --time, the job's time limit ([D-]HH:MM:SS, MM:SS or minutes; quote it)
    container_image: str | None = None  # pyxis --container-image of the trainer (and engines without engine_image)
    container_mounts: str | None = None  # pyxis --container-mounts for the containers (src:dst[,...])
    engine_image: str | None = None  # the SGLang engines' container image (default container_image)
    env: dict = field(default_factory=dict)  # extra environment variables for every rank (name: value)
    # seconds before the time limit at which the job asks the trainer to checkpoint and stop (Slurm's --signal
    # lead); 0: derived by `submit` from the run's measured step time (2 x the mean perf/step_s plus the
    # checkpoint time, see submit.stop_warning_s)
    stop_warning_s: int = 0

    def __post_init__(self):
        check_int("cluster.stop_warning_s", self.stop_warning_s, lo=0)
        for name in ("nodes", "gpus_per_node", "rollout_tp"):
            check_int(f"cluster.{name}", getattr(self, name))
        check_int("cluster.rollout_nodes", self.rollout_nodes, lo=0)
        check_choice("cluster.gpu", self.gpu, CLUSTER_GPUS)
        if self.rollout_nodes >= self.nodes:
            raise ValueError(f"cluster.rollout_nodes: {self.rollout_nodes} leaves no training node of "
                             f"cluster.nodes = {self.nodes}")
        if not isinstance(self.env, dict) or not all(isinstance(k, str) for k in self.env):
            raise ValueError(f"cluster.env: expected a mapping of variable names to values, got {self.env!r}")
        # every value below goes into the batch script `submit` renders: refused here, at load, when a shell or
        # sbatch would read it as anything but the value (the renderer quotes them all as well)
        for name, value in self.env.items():
            if not ENV_NAME.fullmatch(name):
                raise ValueError(f"cluster.env: {name!r} is not a shell identifier ([A-Za-z_][A-Za-z0-9_]*)")
            if name in SCRIPT_VARIABLES:
                raise ValueError(f"cluster.env: {name!r} is the job script's own (or changes how bash runs it): "
                                 "setting it would break the job")
            check_one_line(f"cluster.env.{name}", str(value))
        if not isinstance(self.time, str):
            raise ValueError(f"cluster.time: {self.time!r}: quote it (YAML reads an unquoted 4:00:00 as the "
                             "number 14400)")
        if not SLURM_TIME.fullmatch(self.time):
            raise ValueError(f"cluster.time: {self.time!r} is not a Slurm time ([D-]HH:MM:SS, MM:SS or minutes)")
        limit = slurm_time_s(self.time)
        if self.stop_warning_s and limit and 2 * self.stop_warning_s >= limit:  # the job would stop as it starts
            raise ValueError(f"cluster.stop_warning_s: {self.stop_warning_s} s (--signal) must be less than half of "
                             f"cluster.time {self.time!r} ({limit} s): a warning that long stops the job as soon as "
                             "it starts; use a shorter lead or a longer time limit")
        for name in ("partition", "account"):
            if _numeric_name("cluster", name, getattr(self, name)):  # YAML reads an account 1234 as a number
                object.__setattr__(self, name, str(getattr(self, name)))
            value = getattr(self, name)
            if value in (None, ""):  # none: the cluster's default
                continue
            names = value.split(",") if name == "partition" and isinstance(value, str) else [value]
            if not all(isinstance(x, str) and SLURM_NAME.fullmatch(x) for x in names):
                raise ValueError(f"cluster.{name}: {value!r} is not a Slurm {name} name (letters, digits, _ . -"
                                 f"{'; several comma-separated' if name == 'partition' else ''})")
        for name in ("container_image", "container_mounts", "engine_image"):
            if getattr(self, name) is not None:
                check_one_line(f"cluster.{name}", getattr(self, name))

    @property
    def training_gpus(self) -> int:
        """The training world on this cluster: every rank of the nodes that are not rollout nodes (on a CPU
        cluster, gpus_per_node processes per node)."""
        return (self.nodes - self.rollout_nodes) * self.gpus_per_node

    def describe_training_gpus(self) -> str:
        return (f"(cluster.nodes {self.nodes} - cluster.rollout_nodes {self.rollout_nodes}) x cluster.gpus_per_node "
                f"{self.gpus_per_node} = {self.training_gpus} training ranks")


@dataclass(frozen=True)
class LoggingConfig:
    """metrics.jsonl and TensorBoard always; wandb too when `wandb` is true (project, name, group; mode offline
    writes under <run dir>/wandb without a network, for `wandb sync` later), with the resolved config attached."""

    wandb: bool = False  # also log to Weights & Biases (metrics.jsonl and TensorBoard always)
    wandb_project: str = "megatron-pdm"  # the wandb project
    wandb_name: str | None = None  # the wandb run name (None: the run directory's name)
    wandb_group: str | None = None  # the wandb run group (None: none)
    wandb_mode: str = "online"  # offline: written under <run dir>/wandb without a network, for `wandb sync` later

    def __post_init__(self):
        check_bool("logging.wandb", self.wandb)
        check_choice("logging.wandb_mode", self.wandb_mode, WANDB_MODES)
        for name in ("wandb_project", "wandb_name", "wandb_group"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"logging.{name}: expected a string, got {v!r}")


@dataclass(frozen=True)
class DistillConfig:
    """On-policy distillation (docs/distillation.md, DESIGN.md 2.5b): the student samples, a frozen teacher scores
    every sampled position, and the loss adds coef x D(pi, t) per loss token (`DistillObjective`: kind, beta, coef,
    as_reward, reward_coef), beside the RL loss.

    teacher          the in-trainer teacher: an HF checkpoint directory (any supported family and size; the same
                     tokenizer: its vocab_size must equal model.vocab_size); built at the student's TP, frozen,
                     its logits shard recomputed per micro-batch from its last hidden states; None = off
    teacher_offload  keep the teacher's weights in host memory, copied to the device for its forward pass once per
                     minibatch (as objective.ref_offload)
    """

    teacher: str | None = None
    teacher_offload: bool = False
    kind: str = "reverse"
    beta: float = 0.5
    coef: float = 1.0
    as_reward: bool = False
    reward_coef: float = 1.0

    def __post_init__(self):
        if self.teacher is not None and (not isinstance(self.teacher, str) or not self.teacher):
            raise ValueError(f"distill.teacher: expected an HF checkpoint directory, got {self.teacher!r}")
        check_bool("distill.teacher_offload", self.teacher_offload)
        self.objective  # noqa: B018 - validates kind, beta, coef, as_reward, reward_coef (one-line errors)

    @property
    def objective(self):
        from megatron_pdm.objectives import DistillObjective

        return DistillObjective(kind=self.kind, beta=self.beta, coef=self.coef, as_reward=self.as_reward,
                                reward_coef=self.reward_coef)

    @property
    def enabled(self) -> bool:
        return self.teacher is not None

    def teacher_model(self, student: ModelConfig) -> ModelConfig:
        """The teacher's ModelConfig from its config.json, its vocabulary checked against the student's."""
        path = Path(self.teacher) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"distill.teacher: {path} does not exist (an HF checkpoint directory)")
        try:
            cfg = model_config_from_hf(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"distill.teacher: {path}: {e}") from None
        if cfg.vocab_size != student.vocab_size:
            raise ValueError(f"distill.teacher: {self.teacher} has vocab_size {cfg.vocab_size}, the student "
                             f"{student.vocab_size}: the teacher must share the student's tokenizer and padded "
                             "vocabulary (its logits shard is compared entry by entry)")
        return cfg


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self):
        if self.model.tokenizer is None and self.train.init != "hf" and self.data.task != "arithmetic":
            raise ValueError("model.tokenizer: required (a tokenizer directory) unless train.init is hf, whose "
                             "checkpoint directory then holds the tokenizer")
        if self.rollout.routed_experts and not self.model.is_moe:
            raise ValueError("rollout.routed_experts: true, but the model has no MoE layers (model.num_experts 0)")
        if self.on_cluster and self.cluster.gpu == "cpu":  # the trainer checks its own machine again at start
            problem = moe_kernel_problem(self.model, cuda=False, transformer_engine=False, deep_ep=False)
            if problem:
                raise ValueError(f"{problem} (cluster.gpu 'cpu')")
        rows = self.train.prompts_per_step * self.rollout.n
        if rows % self.train.minibatches:
            raise ValueError(f"train.minibatches: {self.train.minibatches} must divide prompts_per_step x rollout.n "
                             f"= {rows}")
        stale = self.lag or (self.rollout.schedule == "streaming" and self.rollout.max_staleness)
        if stale and self.objective.mask in ("ppo", "none") and self.objective.correction == "none":
            log.warning("rollout.schedule %r: stale rollouts under objective.mask %r and no objective.correction; "
                        "peers report async PPO collapsing without an importance correction (NeMo-RL #1098, "
                        "miles #1829): consider objective.correction tis or mask pdm", self.rollout.schedule,
                        self.objective.mask)
        if self.rollout.schedule == "streaming" and self.train.filter_groups != "none":
            raise ValueError(f"train.filter_groups: {self.train.filter_groups!r} with rollout.schedule 'streaming' is "
                             "not supported (the streaming buffer trains every group it finished, in order); use "
                             "schedule 'sync' or 'lagged' for dynamic sampling")
        if self.objective.divergence in EXACT_KINDS:  # the trainer's behavior is a BehaviorTopK, whatever the mask
            raise ValueError(f"objective.divergence: {self.objective.divergence!r} is an exact (full-vocabulary) "
                             f"divergence and needs mu's full logits, but the rollout engine "
                             f"({self.rollout.engine!r}; every engine alike) returns only mu's top-K "
                             f"log-probs: use one of {', '.join(TOPK_KINDS)}")
        spec = engine_spec(self.rollout.engine)
        if spec.check_run is not None:  # the engine's checks against the model and the cluster
            spec.check_run(self)
        self.check_world_size(*self.training_world_size())
        if self.distill.enabled:
            self._check_distill()

    def _check_distill(self) -> None:
        if self.parallel.pipeline > 1:
            raise ValueError(f"distill.teacher: an in-trainer teacher runs at pipeline size 1 (parallel.pipeline is "
                             f"{self.parallel.pipeline})")
        if self.model.is_moe:
            raise ValueError("distill.teacher: an MoE student replays its routing; an in-trainer teacher is supported "
                             "for dense students")
        if Path(self.distill.teacher).is_dir():  # a cluster path not visible here: the trainer checks at start
            self.distill.teacher_model(self.model)

    @property
    def lag(self) -> int:
        """How many steps older than the trainer's weights a step's rollouts are (0 unless rollout.schedule is
        lagged)."""
        return self.rollout.lag if self.rollout.schedule == "lagged" else 0

    @property
    def off_policy(self) -> bool:
        """Whether a step may train on tokens of older weights than its own (then its batch carries their ages)."""
        return self.lag > 0 or self.rollout.schedule == "streaming"

    @property
    def min_micro_batches(self) -> int:
        """The fewest micro-batches a DP rank may run per minibatch: PP with virtual pipeline stages (megatron's
        interleaved schedule needs that many), else 1."""
        return self.parallel.pipeline if self.parallel.virtual > 1 else 1

    @property
    def on_cluster(self) -> bool:
        """Whether the config names a cluster: a cluster section other than the defaults (YAML or overrides)."""
        return self.cluster != ClusterConfig()

    def training_world_size(self) -> tuple[int, str]:
        """The ranks the trainer runs on, and where that number comes from: a config on a cluster runs there
        (`cluster.training_gpus`, what `submit` starts and `plan` sizes); any other is a local run of
        `megatron-pdm train`, which spawns TP x PP x CP x EP processes (`ParallelConfig.model_parallel_ranks`;
        `--nproc` or torchrun may choose another world, which the trainer checks again). `submit` and `plan` check
        the cluster's world whatever this says."""
        if self.on_cluster:
            return self.cluster.training_gpus, self.cluster.describe_training_gpus()
        ranks = self.parallel.model_parallel_ranks
        return ranks, f"the local run's parallel.tensor x pipeline x context x expert = {ranks} processes"

    def check_world_size(self, world: int, source: str) -> int:
        """What the trainer would refuse on `world` ranks, refused before anything starts: a layout that does not
        tile the world or that megatron-core rejects (`models.layout_of`), and minibatches whose sequences do not
        split evenly over data parallelism (with token budgets: at least one sequence per rank). `source` says
        where `world` comes from. Returns the DP size."""
        try:
            seq = self.data.max_prompt_length + self.rollout.max_new_tokens  # the longest sequence
            dp = layout_of(self.model, self.parallel, world, seq).dp
        except ValueError as e:
            raise ValueError(f"{e} ({source})") from None
        t, n = self.train, self.rollout.n
        rows = t.prompts_per_step * n // t.minibatches
        p = self.parallel
        if p.virtual > 1 and rows // dp < p.pipeline:
            raise ValueError(f"parallel.virtual: {p.virtual} virtual stages run megatron's interleaved schedule, which "
                             f"needs at least parallel.pipeline = {p.pipeline} micro-batches per minibatch; "
                             f"train.prompts_per_step x rollout.n / train.minibatches = {rows} sequences over DP {dp} "
                             f"leave {rows // dp} per rank, with {source}")
        if t.max_tokens_per_microbatch is not None and rows >= dp * self.min_micro_batches:  # any count packs
            return dp
        if rows % dp:
            raise ValueError(f"train.prompts_per_step x rollout.n / train.minibatches = {t.prompts_per_step} x {n} / "
                             f"{t.minibatches} = {rows} sequences per minibatch must be divisible by the data-parallel "
                             f"size {dp} = {world} ranks / (parallel.tensor {p.tensor} x pipeline {p.pipeline} x "
                             f"context {p.context}), with {source}")
        return dp

    @property
    def tokenizer_path(self) -> Path:
        """model.tokenizer; else the checkpoint directory (train.init hf); else the arithmetic task's tokenizer."""
        from .data import ARITHMETIC_TOKENIZER

        if self.model.tokenizer is not None:
            return Path(self.model.tokenizer)
        return Path(self.train.init_path) if self.train.init == "hf" else ARITHMETIC_TOKENIZER

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.default_factory for f in fields(Config)}


def _get(cfg: Config, key: str):
    """The value of a dotted key (`rollout.lag`, `rollout.sglang.urls`)."""
    value = cfg
    for name in key.split("."):
        value = getattr(value, name)
    return value


def _setting(cfg: Config, *keys: str) -> str:
    """`section.key value` for each dotted key, as an inert setting's message names them."""
    return " and ".join(f"{k} {_get(cfg, k)!r}" for k in keys)


def _engine_other_than(name: str) -> Callable[[Config], str | None]:
    return lambda cfg: _setting(cfg, "rollout.engine") if cfg.rollout.engine != name else None


def _no_servers(cfg: Config) -> str | None:
    return None if engine_spec(cfg.rollout.engine).servers else _setting(cfg, "rollout.engine")


def _engine_rows() -> tuple[Inert, ...]:
    """Each engine's sub-section (`rollout.<engine>.*`) acts under that engine only; the settings of engine servers
    (their KV cache, their image) under an engine that runs servers."""
    rows = tuple(Inert(tuple(f"rollout.{spec.name}.{f.name}" for f in fields(spec.config)
                             if f.name not in spec.exclusive), ("rollout.engine",),
                       _engine_other_than(spec.name),
                       f"a setting of the {spec.name} engine (rollout.engine: {spec.name})", refuse=True)
                 for spec in ENGINES.values() if spec.config is not None)
    return (*rows, Inert(("precision.kv_cache", "cluster.engine_image"), ("rollout.engine",), _no_servers,
                         "a setting of engine servers; the embedded engine runs in the trainer", refuse=True))


def _on_policy(cfg: Config) -> str | None:
    lagged = cfg.rollout.schedule == "lagged"
    return None if cfg.off_policy else _setting(cfg, "rollout.schedule", *(("rollout.lag",) if lagged else ()))


def _remote_reward(cfg: Config) -> str | None:
    from .remote_reward import is_remote

    return None if is_remote(cfg.data.reward) else _setting(cfg, "data.reward")


@dataclass(frozen=True)
class Inert:
    """Settings that act only under others': each of `keys` does nothing while `when(cfg)` names the settings that
    make it so (None while it acts), which are among `gates`; `why` says what it is for. `unset`: the key's value
    when not given, where other fields derive it (else its field's default).

    refuse: a key set while the user set none of its gates is an error (its feature is off by default, so they
    almost surely expected an effect, and the fix is one line); with a gate set, a warning (a shared config's key
    under an override that turns its feature off, or a resolved config, which holds every key). Without refuse, a
    warning either way: keys that configs shared across schedules, masks or precisions carry harmlessly."""

    keys: tuple[str, ...]
    gates: tuple[str, ...]
    when: Callable[[Config], str | None]
    why: str
    refuse: bool = False
    unset: Callable[[Config], object] | None = None


# every setting that acts only under another's value. Not here: settings some other code path still reads (the
# divergence, delta and tail feed the trust-region metrics under any mask; micro_batch_size sizes `analyze`'s
# batches under token budgets; sync_bucket_bytes buckets the embedded engine's updates; `plan` sizes engines of
# cluster.rollout_tp GPUs for an embedded engine too; ffn_hidden_size of an all-MoE model mirrors its checkpoint's
# config.json; the eval settings: every run evaluates), and those refused where they are checked (system_prompt,
# warm_start_key and arithmetic_prompt, refill, cpu_offload, ref_offload, correction_level, max_turns, the sglang
# engine's urls / num_engines / router / release_memory under another engine (its spec's `exclusive`), deepseek_v3's
# fields, first / last_stage_layers)
INERT = (
    Inert(("rollout.lag",), ("rollout.schedule",),
          lambda c: _setting(c, "rollout.schedule") if c.rollout.schedule != "lagged" else None,
          "the lag of schedule 'lagged' (how many steps older than the trainer's its rollouts' weights are)"),
    Inert(("rollout.max_staleness", "rollout.partial"), ("rollout.schedule",),
          lambda c: _setting(c, "rollout.schedule") if c.rollout.schedule != "streaming" else None,
          "a setting of schedule 'streaming'"),
    Inert(("rollout.segment_tokens",), ("rollout.schedule", "rollout.partial"),
          lambda c: _setting(c, "rollout.schedule") if c.rollout.schedule != "streaming"
          else None if c.rollout.partial else _setting(c, "rollout.partial"),
          "schedule 'streaming' generates a segment per step with partial rollouts only (else every sample whole)",
          unset=lambda c: default_segment_tokens(c.rollout.max_new_tokens)),
    Inert(("rollout.overlap",), ("rollout.schedule", "rollout.lag"), _on_policy,
          "each step's rollouts come from its own weights, so none can be generated while it trains"),
    Inert(("objective.max_token_age",), ("rollout.schedule", "rollout.lag"), _on_policy,
          "every token is the trainer's own version (age 0): it drops nothing"),
    Inert(("rollout.overlong_buffer", "rollout.overlong_penalty_factor"), ("rollout.overlong",),
          lambda c: _setting(c, "rollout.overlong") if c.rollout.overlong != "penalty" else None,
          "it shapes DAPO's soft overlong penalty (rollout.overlong: penalty)", refuse=True),
    # before the engine rows, which report a key no more (the sync's settings are its gate too)
    Inert(("rollout.sglang.weight_dir",), ("rollout.engine", "rollout.sglang.weight_sync"),
          lambda c: _engine_other_than("sglang")(c) or (_setting(c, "rollout.sglang.weight_sync")
                                                        if c.rollout.sglang.weight_sync != "disk" else None),
          "the directory of disk weight syncs to SGLang engines (rollout.sglang.weight_sync: disk)", refuse=True),
    *_engine_rows(),
    # urls are refused under another engine (rollout.sglang.urls given: engine sglang)
    Inert(("rollout.sglang.server", "rollout.sglang.server_args", "rollout.sglang.engine_python"),
          ("rollout.sglang.urls", "rollout.engine"),
          lambda c: "rollout.sglang.urls given (engines attached to, not launched)"
          if c.rollout.sglang.urls and not c.on_cluster else None,
          "a setting of the engines the trainer or `submit` launches"),
    Inert(("data.max_operand",), ("data.task", "data.train_path"),
          lambda c: _setting(c, "data.task") if c.data.task != "arithmetic" else None,
          "the arithmetic task's operand range"),
    Inert(("data.train_path",), ("data.task",),
          lambda c: _setting(c, "data.task") if c.data.task == "arithmetic" else None,
          "the arithmetic task makes its own problems (data.task: dataset reads train_path)"),
    Inert(("data.prompt_key", "data.answer_key"), ("data.task", "data.train_path", "data.eval_paths"),
          lambda c: "data.task 'arithmetic' and no data.eval_paths"
          if c.data.task == "arithmetic" and not c.data.eval_paths else None,
          "a key of dataset records (data.train_path, data.eval_paths)", refuse=True),
    Inert(("data.chat_template_kwargs",),
          ("data.chat_template", "data.warm_start_key", "rollout.tool_fn", "rollout.generate_fn"),
          lambda c: _setting(c, "data.chat_template") + " and no multi-turn (data.warm_start_key, rollout.tool_fn, "
          "rollout.generate_fn)" if not (c.data.chat_template or c.data.warm_start_key or c.rollout.tool_fn
                                         or c.rollout.generate_fn) else None,
          "they go to the tokenizer's chat template, which renders nothing then", refuse=True),
    Inert(("data.reward_concurrency", "data.reward_retries", "data.reward_timeout_s"), ("data.reward",),
          _remote_reward, "a setting of a reward server (an http(s) URL); a local reward runs in the trainer"),
    Inert(("data.warm_start_key", "train.warm_start_lr"), ("train.warm_start_steps",),
          lambda c: None if c.train.warm_start_steps else _setting(c, "train.warm_start_steps"),
          "a setting of the supervised warm start"),
    Inert(("train.init_path",), ("train.init",),
          lambda c: _setting(c, "train.init") if c.train.init != "hf" else None,
          "the HF checkpoint that train.init: hf starts from", refuse=True),
    Inert(("train.max_rollout_rounds",), ("train.refill",),
          lambda c: None if c.train.refill else _setting(c, "train.refill"),
          "the bound on refill's rollouts per step", refuse=True),
    Inert(("objective.kl_type", "objective.kl_unbiased"), ("objective.kl_coef",),
          lambda c: None if c.objective.kl_coef else _setting(c, "objective.kl_coef"),
          "a setting of the KL penalty to the reference policy (off at kl_coef 0)", refuse=True),
    Inert(("objective.correction_cap",), ("objective.correction",),
          lambda c: _setting(c, "objective.correction") if c.objective.correction not in ("tis", "mis") else None,
          "the cap of corrections tis and mis", refuse=True),
    Inert(("objective.icepop_low", "objective.icepop_high"), ("objective.correction",),
          lambda c: _setting(c, "objective.correction") if c.objective.correction != "icepop" else None,
          "the band of correction icepop", refuse=True),
    Inert(("objective.rejection_threshold",), ("objective.rejection",),
          lambda c: _setting(c, "objective.rejection") if c.objective.rejection == "none" else None,
          "the bound of rejection k1 / k3", refuse=True),
    Inert(("objective.eps_low", "objective.eps_high"), ("objective.mask", "objective.loss"),
          lambda c: _setting(c, "objective.mask", "objective.loss")
          if "ppo" not in (c.objective.mask, c.objective.loss) else None,
          "PPO's clip range (mask ppo, loss ppo)"),
    Inert(("objective.advantage_std_eps",), ("objective.advantage",),
          lambda c: _setting(c, "objective.advantage") if c.objective.advantage != "grpo" else None,
          "grpo's guard on the group std (dr_grpo and rloo divide by none)"),
    Inert(("precision.fp8_recipe",), ("precision.train",),
          lambda c: _setting(c, "precision.train") if c.precision.train != "fp8" else None,
          "Transformer Engine's scaling recipe under precision.train fp8"),
    Inert(("precision.loss_scale",), ("precision.train", "optim.distributed_optimizer"),
          lambda c: "precision.train 'fp32' without optim.distributed_optimizer"
          if c.precision.train == "fp32" and not c.optim.distributed_optimizer
          and c.precision.loss_scale not in ("dynamic", "none") else None,
          "megatron's plain fp32 optimizer scales no loss"),
    Inert(("model.moe_ffn_hidden_size", "model.moe_router_topk", "model.moe_aux_loss_coeff",
           "model.moe_norm_topk_prob", "model.moe_token_dispatcher_type", "model.moe_enable_deepep",
           "model.moe_grouped_gemm"), ("model.model_type", "model.num_experts"),
          lambda c: None if c.model.is_moe else _setting(c, "model.model_type", "model.num_experts"),
          "a setting of MoE layers", refuse=True),
    Inert(("model.rope_scaling_factor", "model.rope_original_max_position_embeddings"), ("model.rope_scaling",),
          lambda c: _setting(c, "model.rope_scaling") if c.model.rope_scaling == "none" else None,
          "a setting of RoPE scaling (llama3, yarn)", refuse=True),
    Inert(("model.rope_low_freq_factor", "model.rope_high_freq_factor"), ("model.rope_scaling",),
          lambda c: _setting(c, "model.rope_scaling") if c.model.rope_scaling != "llama3" else None,
          "a setting of RoPE scaling llama3", refuse=True),
    Inert(("model.rope_beta_fast", "model.rope_beta_slow", "model.rope_mscale", "model.rope_mscale_all_dim"),
          ("model.rope_scaling",),
          lambda c: _setting(c, "model.rope_scaling") if c.model.rope_scaling != "yarn" else None,
          "a setting of RoPE scaling yarn", refuse=True),
    Inert(("cluster.container_mounts",), ("cluster.container_image", "cluster.engine_image"),
          lambda c: "no cluster.container_image or engine_image"
          if not (c.cluster.container_image or c.cluster.engine_image) else None,
          "the mounts of the job's containers", refuse=True),
    Inert(("distill.teacher_offload", "distill.kind", "distill.beta", "distill.coef", "distill.as_reward",
           "distill.reward_coef"), ("distill.teacher",),
          lambda c: None if c.distill.enabled else _setting(c, "distill.teacher"),
          "a setting of on-policy distillation, which needs a teacher", refuse=True),
    Inert(("distill.beta",), ("distill.kind",),
          lambda c: None if c.distill.kind == "jsd" or not c.distill.enabled else _setting(c, "distill.kind"),
          "the generalized JSD's mixture weight"),
    Inert(("distill.reward_coef",), ("distill.as_reward",),
          lambda c: None if c.distill.as_reward or not c.distill.enabled else _setting(c, "distill.as_reward"),
          "the weight of the per-token teacher reward"),
    Inert(("logging.wandb_project", "logging.wandb_name", "logging.wandb_group", "logging.wandb_mode"),
          ("logging.wandb",), lambda c: None if c.logging.wandb else _setting(c, "logging.wandb"),
          "a setting of the wandb logger"),
)


def _default(cfg: Config, key: str):
    *path, name = key.split(".")
    f = next(f for f in fields(_get(cfg, ".".join(path))) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def check_inert(cfg: Config, given: set[str]) -> None:
    """Each key the user gave (`given`: the dotted keys of the YAML and the overrides) that does nothing under the
    other settings (`INERT`): a ValueError or a warning naming it, its value and the settings that make it so. A
    value equal to the one it would have unset changes nothing and passes: resolved configs (a run's config.yaml,
    `submit`'s) hold every key. A key is reported once, by the first row that finds it inert."""
    reported = set()
    for row in INERT:
        inert = row.when(cfg)
        if not inert:
            continue
        for key in row.keys:
            value = _get(cfg, key)
            if key in reported or key not in given or value == (row.unset(cfg) if row.unset else _default(cfg, key)):
                continue
            reported.add(key)
            message = f"{key}: {value!r} does nothing with {inert}: {row.why}"
            if row.refuse and not given & set(row.gates):
                raise ValueError(f"{message}; remove it, or set {' / '.join(row.gates)}")
            log.warning("%s", message)


def _model_section(d: dict) -> dict:
    """The model section; with train.init hf it is read from the checkpoint's config.json, and what the config
    gives must agree with it (every differing field named), except the settings that are not the architecture."""
    given = d.get("model") or {}
    train = d.get("train") or {}
    if train.get("init") != "hf" or not isinstance(train.get("init_path"), str) or not isinstance(given, dict):
        return given
    path = Path(train["init_path"]) / "config.json"
    if not path.is_file():
        if set(given) - NOT_ARCHITECTURE:  # e.g. a cluster path not visible here: the trainer checks at start
            return given
        raise FileNotFoundError(f"train.init_path: {path} does not exist; without a model section the model is "
                                "read from the checkpoint's config.json")
    try:
        ckpt = model_config_from_hf(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"train.init_path: {path}: {e}") from None
    merged = {**dataclasses.asdict(ckpt), **given}
    # the kind of model first: the other fields are checked in a config of the checkpoint's kind
    kind = {"model_type": ckpt.model_type, "num_experts": ckpt.num_experts}
    diffs = architecture_mismatches(from_dict(ModelConfig, {**merged, **kind}, "model"), ckpt)
    for name in kind:
        if name in given and given[name] != getattr(ckpt, name):
            diffs.insert(0, f"model.{name}: {given[name]!r} (checkpoint: {getattr(ckpt, name)!r})")
    if diffs:
        raise ValueError(f"model: differs from the checkpoint {path}: {'; '.join(diffs)} (leave the model "
                         "section out to take the checkpoint's)")
    return merged


def _moved_temperature(d: dict) -> dict:
    """The sampling temperature has one home, rollout.temperature (the trainer divides its logits by it too). A config
    from before, with objective.temperature, still loads: its value moves to rollout.temperature, with a warning; an
    error when both are given and differ."""
    objective, rollout = d.get("objective"), d.get("rollout") or {}
    if not isinstance(objective, dict) or "temperature" not in objective or not isinstance(rollout, dict):
        return d
    objective = dict(objective)
    t = objective.pop("temperature")
    if "temperature" in rollout and rollout["temperature"] != t:
        raise ValueError(f"objective.temperature: {t!r} differs from rollout.temperature {rollout['temperature']!r}; "
                         "the temperature is one setting, rollout.temperature (the sampling T, by which the trainer "
                         "also divides its logits): remove objective.temperature")
    log.warning("objective.temperature: removed; read as rollout.temperature = %r (the sampling T, by which the "
                "trainer also divides its logits): set rollout.temperature instead", t)
    return {**d, "objective": objective, "rollout": {**rollout, "temperature": t}}


# what YAML 1.1 makes of unquoted text that is not a string: a field typed str (or str | None) holding one is
# refused (`quote it`), since the text is lost: 0123 reads as the octal 83, 4:00:00 as 14400, 2024-05-01 as a date
YAML_NON_STRINGS = (bool, int, float, datetime.date)
# string fields where a plain number is a name as it stands (an account 1234): taken as its decimal text, as before
# these checks (in a file YAML has lost how it was written; an override keeps it: 0123 there is refused)
NUMERIC_NAMES = {("cluster", "account"), ("cluster", "partition")}


def _moved_engine_keys(d: dict) -> dict:
    """A config from before the engines' sub-sections, with an engine's keys flat under `rollout` (rollout.urls),
    still loads for one release: each key its spec lists (`EngineSpec.moved`) moves into the engine's sub-section
    (rollout.sglang.urls), with one warning naming the old and the new key; an error when both are given and
    differ."""
    rollout = d.get("rollout")
    if not isinstance(rollout, dict) or not any(k in rollout for s in ENGINES.values() for k in s.moved):
        return d
    rollout = dict(rollout)
    for spec in ENGINES.values():
        old = [k for k in spec.moved if k in rollout]
        sub = rollout.get(spec.name) or {}
        if not old or not isinstance(sub, dict):  # a sub-section that is not a mapping: from_dict names it
            continue
        sub = dict(sub)
        for key in old:
            value, new = rollout.pop(key), f"rollout.{spec.name}.{key}"
            if key in sub and sub[key] != value:
                raise ValueError(f"rollout.{key}: {value!r} differs from {new} {sub[key]!r}; rollout.{key} moved to "
                                 f"{new}: remove rollout.{key}")
            log.warning("rollout.%s: moved to %s (read as %s = %r); set %s instead", key, new, new, value, new)
            sub[key] = value
        rollout[spec.name] = sub
    return {**d, "rollout": rollout}


def _sub_section(cls, name: str):
    """The dataclass of field `name` of `cls` when it is a sub-section (rollout.sglang), else None."""
    f = next((f for f in fields(cls) if f.name == name), None)
    factory = f.default_factory if f is not None else dataclasses.MISSING
    return factory if dataclasses.is_dataclass(factory) else None


def _given(d: dict) -> set[str]:
    """The dotted keys of a config dict, a sub-section's keys each (rollout.sglang.urls)."""
    keys = set()
    for section, values in d.items():
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            sub = _sub_section(type(SECTIONS[section]()), key) if section in SECTIONS else None
            if sub is not None and isinstance(value, dict):
                keys |= {f"{section}.{key}.{k}" for k in value}
            else:
                keys.add(f"{section}.{key}")
    return keys


def _shown(value) -> str:
    """A YAML-read value as an error shows it: a date or time as YAML wrote it, anything else as its repr."""
    return value.isoformat() if isinstance(value, (datetime.date, datetime.time)) else repr(value)


def _numeric_name(section: str, name: str, value) -> bool:
    return (section, name) in NUMERIC_NAMES and isinstance(value, int) and not isinstance(value, bool)


def _string_fields(section: str, cls, values) -> None:
    """Refuse a str-typed field that YAML read as a number, a bool or a date, naming the field and the value (in the
    section's sub-sections too)."""
    if not isinstance(values, dict):
        return  # from_dict names the section
    for f in fields(cls):
        value = values.get(f.name)
        sub = _sub_section(cls, f.name)
        if sub is not None:
            _string_fields(f"{section}.{f.name}", sub, value)
        if f.type in ("str", "str | None") and isinstance(value, YAML_NON_STRINGS) \
                and not _numeric_name(section, f.name, value):
            shown = _shown(value)
            raise ValueError(f"{section}.{f.name}: {shown}: quote it (a string field, which YAML read as the "
                             f"{type(value).__name__} {shown}: unquoted, 0123 reads as the octal 83, 4:00:00 as "
                             "the number 14400, 2024-05-01 as a date)")


def config_from_dict(d: dict) -> Config:
    unknown = sorted(set(d) - set(SECTIONS))
    if unknown:
        raise ValueError(f"config: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    d = {name: {} if value is None else value for name, value in d.items()}  # `cluster:` with nothing under it
    d = _moved_engine_keys(_moved_temperature(d))
    d = {**d, "model": _model_section(d)}
    # the keys given (train.init hf: the checkpoint's model fields too, as a resolved config's, beside the user's)
    given = _given(d)
    for name in SECTIONS:
        _string_fields(name, type(SECTIONS[name]()), d.get(name, {}))
    cfg = Config(**{name: from_dict(type(SECTIONS[name]()), d.get(name, {}), name) for name in SECTIONS})
    check_inert(cfg, given)
    return cfg


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader (YAML 1.1), which reads 3e-3 as a string, plus YAML 1.2's floats without a dot."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                              list("-+0123456789."))


def _not_json(value, path: str):
    """The first (dotted path, value) in a YAML-loaded value that JSON cannot hold (a date, a set, bytes), or None."""
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if not isinstance(k, (str, int, float, bool, type(None))):
                return where, k
            found = _not_json(v, where)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _not_json(v, f"{path}[{i}]")
            if found:
                return found
    elif not isinstance(value, (str, int, float, bool, type(None))):
        return path, value
    return None


def _plain(d: dict) -> dict:
    """A copy of `d` as JSON holds it (keys strings, tuples lists); a value JSON cannot hold (YAML reads an unquoted
    2024-05-01 as a date) is a ValueError naming its field."""
    try:
        return json.loads(json.dumps(d))
    except TypeError:
        found = _not_json(d, "")
        if found is None:
            raise
        where, value = found
        shown = _shown(value)
        raise ValueError(f"{where or 'config'}: {shown}: quote it (YAML read it as a {type(value).__name__}, which a "
                         "config value cannot be)") from None


def _override_value(item: str, key: str, text: str):
    """An override's value, parsed as YAML: unparsable YAML, or a ` #...` that YAML would drop as a comment, is a
    ValueError naming the override and the field (quote the value to pass it as a string)."""
    quote = f"quote it ({key}=\"'...'\" in a shell) to pass it as a string"
    try:
        tokens = list(yaml.scan(text, Loader=_Loader))
        value = yaml.load(text, Loader=_Loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"override {item!r}: {key}: {text!r} is not a YAML value ({problem}); {quote}") from None
    for m in re.finditer(r"(?:^|(?<=\s))#", text):  # a comment: '#' first or after a space, outside every token
        if not any(t.start_mark.index <= m.start() < t.end_mark.index for t in tokens):
            raise ValueError(f"override {item!r}: {key}: YAML reads {text[m.start():]!r} as a comment and drops it "
                             f"(the value would be {value!r}); {quote}")
    return value


def _moved_override(key: str) -> str:
    """An override's key, a flat engine key of the previous release (rollout.urls) moved into its engine's
    sub-section (rollout.sglang.urls) with one warning naming both."""
    section, _, name = key.partition(".")
    spec = next((s for s in ENGINES.values() if name in s.moved), None) if section == "rollout" else None
    if spec is None:
        return key
    new = f"rollout.{spec.name}.{name}"
    log.warning("%s: moved to %s (the override is read as %s); set %s instead", key, new, new, new)
    return new


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    """`section.key=value` or `section.sub.key=value` strings (value parsed as YAML) applied to a config dict, after
    the flat engine keys of the previous release are moved to their sub-sections (`_moved_engine_keys`)."""
    d = _moved_engine_keys(_plain(d))
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(f"override {item!r}: expected section.key=value")
        key, text = item.split("=", 1)
        key = _moved_override(key)
        section, name = key.split(".", 1)
        if section not in SECTIONS:
            raise ValueError(f"override {item!r}: unknown section {section!r}; known: {', '.join(SECTIONS)}")
        value = _override_value(item, key, text)
        cls, (*subs, name) = type(SECTIONS[section]()), name.split(".")
        for sub in subs:  # a sub-section's key (rollout.sglang.urls)
            cls = _sub_section(cls, sub) if cls is not None else None
        if cls is None:
            raise ValueError(f"override {item!r}: {key}: no such sub-section in {section}")
        kind = next((f.type for f in fields(cls) if f.name == name), None)
        numeric = _numeric_name(section, name, value) and str(value) == text.strip()  # 1234, not 0123 (83)
        if kind in ("str", "str | None") and isinstance(value, YAML_NON_STRINGS) and not numeric:  # the text as written
            shown = _shown(value)
            raise ValueError(f"override {item!r}: {key}: {shown}: quote it (the field is a string, and YAML reads "
                             f"{text!r} as the {type(value).__name__} {shown}; {key}=\"'{text}'\" in a shell)")
        target, path = d, []
        for part in (section, *subs):
            path.append(part)
            if target.get(part) is None:  # absent, or `section:` with nothing under it
                target[part] = {}
            if not isinstance(target[part], dict):
                raise ValueError(f"override {item!r}: {'.'.join(path)}: expected a mapping, got "
                                 f"{type(target[part]).__name__}")
            target = target[part]
        target[name] = value
    return d


def read_config_dict(path: str | Path | None, overrides: list[str] = ()) -> dict:
    """The config file's sections (none without a path) with `overrides` applied, not yet checked."""
    d = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config: {path} does not exist")
        d = yaml.load(path.read_text(), Loader=_Loader) or {}  # noqa: S506 - a safe loader
        if not isinstance(d, dict):
            raise ValueError(f"config: {path} must hold a mapping of sections")
    return apply_overrides(d, list(overrides))


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    return config_from_dict(read_config_dict(path, overrides))
