"""`RolloutConfig` (the config's `rollout` section), beside the engines that consume it: what generates the
rollouts, how, and on which schedule. `build_engine` (factory.py) turns it into a `RolloutEngine` through the spec
of the engine it names (engines.py); each engine's own settings are its sub-section (`rollout.sglang`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from megatron_pdm._dataclass import from_dict
from megatron_pdm._userfn import load_function
from megatron_pdm._validate import check_bool, check_choice, check_finite, check_int, check_number
from megatron_pdm.models.hf import DEFAULT_BUCKET_BYTES

from .engines import ENGINES
from .sglang.config import SGLangConfig

log = logging.getLogger(__name__)
OVERLONG_RESPONSES = ("keep", "mask", "penalty")
SCHEDULES = ("sync", "lagged", "streaming")


def default_segment_tokens(max_new_tokens: int) -> int:
    """rollout.segment_tokens when not given: half of max_new_tokens, rounded up."""
    return -(-max_new_tokens // 2)


@dataclass(frozen=True)
class RolloutConfig:
    """engine embedded (an in-process inference copy) or sglang (SGLang HTTP workers, set up by the `sglang`
    sub-section; engines.py lists the engines). `routed_experts` asks MoE engines for the experts they routed every
    token to and replays them in the trainer (R3). top_p / top_k other than 1 / -1 truncate sampling, which the masks
    do not model: allowed, with a warning."""

    engine: str = "embedded"
    # the weight sync's bucket: each pipeline stage's sender holds at most one (train/weight_sync.py)
    sync_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    routed_experts: bool = False
    n: int = 8  # samples per prompt (the GRPO group size)
    # the sampling temperature T of mu, and the T of the trainer's pi = softmax(z / T): the run's one temperature
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 4  # the most response tokens a sample generates (all turns together)
    # responses cut at max_new_tokens: keep them, mask them out of the loss, or add DAPO's soft overlong penalty
    # (0 up to max_new_tokens - overlong_buffer tokens, then linearly down to -overlong_penalty_factor)
    overlong: str = "keep"
    overlong_buffer: int = 0  # tokens before max_new_tokens where the overlong penalty starts (overlong: penalty)
    overlong_penalty_factor: float = 1.0  # the penalty at max_new_tokens (overlong: penalty)
    # which weights generate each step's rollouts (train/schedule.py): sync, the weights of the step that trains on
    # them; lagged, those of `lag` steps before (1: one-step-off); streaming, groups admitted up to `max_staleness`
    # versions ahead of the trainer and generated `segment_tokens` per sample per step, a sample cut by a weight
    # update continued under the new weights (`partial`; false: every sample generated whole in one step). Produced
    # while the trainer trains when `overlap` (false: the same rollouts, produced after each step instead)
    schedule: str = "sync"
    lag: int = 1  # schedule lagged: step s trains on the rollouts of version max(s - lag, 0)
    max_staleness: int = 1  # schedule streaming: the most versions a token may lag the weights it trains
    partial: bool = True  # schedule streaming: continue samples cut by a weight update (false: generate whole)
    segment_tokens: int | None = None  # streaming, partial: tokens a sample gets per round (None: max_new_tokens / 2)
    overlap: bool = True  # produce rollouts while the trainer trains (false: after each step; the same rollouts)
    # multi-turn rollouts (rollout/multi_turn.py), a `module:function` / `file.py:function` either way: tool_fn, the
    # environment's reply after each turn of the policy, fn(sample, problem, ctx) -> token ids or None (every
    # schedule); or generate_fn, whole responses in place of engine.generate, fn(engine, prompts, params, ctx) ->
    # samples (sync, lagged); and the most policy turns per response
    tool_fn: str | None = None  # module:function, the environment's reply after each policy turn (multi-turn)
    generate_fn: str | None = None  # module:function generating whole responses in place of the engine's generate
    max_turns: int = 1  # the most policy turns per response (multi-turn)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)  # the sglang engine's settings (sglang/config.py)

    def __post_init__(self):
        check_finite("rollout", self)
        check_choice("rollout.engine", self.engine, ENGINES)
        for spec in ENGINES.values():  # each engine's sub-section, a mapping when read from YAML
            if spec.config is not None and isinstance(getattr(self, spec.name), dict):
                object.__setattr__(self, spec.name, from_dict(spec.config, getattr(self, spec.name),
                                                              f"rollout.{spec.name}"))
        check_int("rollout.n", self.n)
        check_number("rollout.temperature", self.temperature, lo=0.0, lo_open=True)
        check_int("rollout.max_new_tokens", self.max_new_tokens)
        check_int("rollout.sync_bucket_bytes", self.sync_bucket_bytes)
        check_number("rollout.top_p", self.top_p, lo=0.0, hi=1, lo_open=True)
        check_int("rollout.top_k", self.top_k, special=-1, special_note="no truncation")
        check_bool("rollout.routed_experts", self.routed_experts)
        check_choice("rollout.overlong", self.overlong, OVERLONG_RESPONSES)
        check_choice("rollout.schedule", self.schedule, SCHEDULES)
        check_int("rollout.lag", self.lag, lo=0)
        check_int("rollout.max_staleness", self.max_staleness, lo=0)
        for name in ("overlap", "partial"):
            check_bool(f"rollout.{name}", getattr(self, name))
        if self.segment_tokens is None:
            object.__setattr__(self, "segment_tokens", default_segment_tokens(self.max_new_tokens))
        check_int("rollout.segment_tokens", self.segment_tokens)
        for spec in ENGINES.values():  # each engine's sub-section against the rest of the section
            if spec.validate is not None:
                spec.validate(self)
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
        if self.top_p != 1 or self.top_k != -1:
            log.warning("rollout.top_p=%s, rollout.top_k=%s: truncated sampling; the masks and importance ratios "
                        "assume the untruncated distribution mu = softmax(logits / T), which these samples do not "
                        "follow", self.top_p, self.top_k)

    @property
    def engine_config(self):
        """The sub-section of the engine this section names (None: an engine without settings of its own)."""
        return getattr(self, self.engine) if ENGINES[self.engine].config is not None else None

    @property
    def releases_memory(self) -> bool:
        """Whether the engine frees its memory while the trainer trains (colocated engines: `release_memory` in its
        sub-section)."""
        return bool(getattr(self.engine_config, "release_memory", False))
