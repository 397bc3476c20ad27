"""Multi-turn rollouts: the policy's turns alternate with an environment's (a tool's reply), in one response.

A `rollout.generate_fn` (slime's custom-generate hook) replaces the one `engine.generate` of a rollout:
`fn(engine, prompts, params, ctx) -> samples`, params.n samples per prompt in the order `generate` returns them.
`multi_turn` is the loop most such functions want: generate; then, up to ctx.max_turns turns of the policy, give
every sample that stopped to `reply`, append the reply's tokens (`RolloutSample.with_turn`: in the context, out of
the loss) and continue the sample with `engine.extend`, which prefills them and samples on from there with the
sample's own seed at its own positions. Every turn is a segment of one response: rollout.max_new_tokens bounds
all of it, replies included. Only the `RolloutEngine` protocol is used, so it runs on every engine alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from megatron_pdm.models.tokenizer import Tokenizer

from .base import RolloutEngine, RolloutSample, SamplingParams

# a sample whose policy turn just stopped -> the tokens of the environment's reply (`Tokenizer.turn_ids` renders
# one as the chat template does, after a turn that ended with the EOS token; a turn that ended with another stop
# token, Qwen3's <|endoftext|>, is a final one), or None when the policy's turn was its final answer
Reply = Callable[[RolloutSample], "list[int] | None"]


@dataclass(frozen=True)
class GenerateContext:
    """What a generate_fn gets besides the engine, the prompts and the sampling params: the tokenizer, the most
    policy turns per response (rollout.max_turns), the chat template's kwargs (data.chat_template_kwargs) and each
    prompt's problem (problems[i] for prompts[i]: its prompt, answer and dataset record as `metadata`)."""

    tokenizer: Tokenizer
    max_turns: int
    template_kwargs: dict = field(default_factory=dict)
    problems: list[Any] = field(default_factory=list)


GenerateFn = Callable[[RolloutEngine, "list[list[int]]", SamplingParams, GenerateContext], "list[RolloutSample]"]


def with_reply(sample: RolloutSample, ids: list[int], max_new_tokens: int) -> RolloutSample:
    """`sample` followed by a reply's tokens, to be continued (`RolloutSample.with_turn`), when at least one token
    of the policy still fits in max_new_tokens; else the sample as it is, cut (finish "length": the turn that asked
    for the reply is kept, and rollout.overlong: mask takes it out of the loss)."""
    if len(sample.response_ids) + len(ids) >= max_new_tokens:
        return replace(sample, finish_reason="length")
    return sample.with_turn(list(ids))


def multi_turn(engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, reply: Reply, *,
               max_turns: int) -> list[RolloutSample]:
    """params.n samples per prompt of up to max_turns policy turns each, in `generate`'s order. After each turn, a
    sample that stopped (its stop token) gets reply(sample); a reply is appended and the sample continued by one
    `extend` of all such samples. A sample ends when its turn is the final one (reply None), after max_turns
    turns, or when it runs out of tokens (`with_reply`)."""
    samples = engine.generate(prompts, params)
    final = set()  # samples whose last turn was their answer: a tool runs once per turn
    for _ in range(max_turns - 1):
        todo = []
        for k, s in enumerate(samples):
            ids = reply(s) if s.finish_reason == "stop" and k not in final else None
            if not ids:
                final.add(k)
                continue
            samples[k] = with_reply(s, ids, params.max_new_tokens)
            if samples[k].finish_reason == "abort":  # appended, to be continued
                todo.append(k)
        if not todo:
            break
        for k, s in zip(todo, engine.extend([samples[k] for k in todo], params), strict=True):
            samples[k] = s
    return samples
