"""A calculator tool for multi-turn rollouts: the policy writes an expression, the tool replies with its value in
a tool turn of the chat template, the policy answers. Used by examples/calculator.yaml:

    rollout.tool_fn:  examples/calculator.py:reply    (the reply after each policy turn; every schedule)
    data.reward:      examples/calculator.py:reward   (the policy's final turn against the answer)

`generate` is the same loop written as a rollout.generate_fn (slime's custom-generate hook), for a run that needs
its own control of the engine calls (sync and lagged schedules).

Two-digit products (`37*58=`) are beyond the tiny model's arithmetic and trivial with the tool. The warm start
learns the protocol from demonstrations (data.warm_start_key: expression, the tool's reply, the value), RL
learns to use it well. Write the datasets (seeded; they are committed under examples/data/) with

    python examples/calculator.py --write-data examples/data
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
import re
from pathlib import Path

from megatron_pdm.rollout.multi_turn import multi_turn
from megatron_pdm.train.data import exact_number_reward

_CALL = re.compile(r"[\d\s()+*-]*\d\s*[+*-][\d\s()+*-]*")  # digits, + - * and parentheses, one operator at least
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """The value of an integer expression of + - * and parentheses, or "error": walks the parsed tree and
    evaluates nothing else (no eval), at most 64 characters and results below 10**12."""
    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            out = _OPS[type(node.op)](value(node.left), value(node.right))
            if abs(out) >= 10**12:
                raise ValueError("too large")
            return out
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("not arithmetic")

    try:
        if len(expression) > 64:
            raise ValueError("too long")
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "error"


def reply(sample, problem, ctx):
    """rollout.tool_fn: a policy turn that is an expression (`_CALL`) gets the calculator's value in a tool turn
    (rendered as the chat template renders one); any other turn is the final answer (None)."""
    text = ctx.tokenizer.decode(sample.last_turn().tolist()).strip()
    if int(sample.response_ids[-1]) != ctx.tokenizer.eos_id or not _CALL.fullmatch(text):  # another stop: final
        return None
    return ctx.tokenizer.turn_ids([{"role": "tool", "content": calculate(text)}], **ctx.template_kwargs)


def generate(engine, prompts, params, ctx):
    """rollout.generate_fn: up to ctx.max_turns policy turns with `reply` between them."""
    return multi_turn(engine, prompts, params, lambda s: reply(s, ctx.problems[s.prompt_index], ctx),
                      max_turns=ctx.max_turns)


def reward(response: str, answer: str, metadata: dict) -> float:
    """1 if the policy's final turn starts its numbers with the answer: the text after the last tool turn (the
    response is decoded without special tokens, so ChatML's tool turn ends in a bare "assistant" line)."""
    return exact_number_reward(response.rsplit("\nassistant\n", 1)[-1], answer)


def problems(pairs, rng) -> list[dict]:
    out = []
    for a, b in pairs:
        expr, value = f"{a}*{b}", str(a * b)
        out.append({"prompt": f"{expr}=", "answer": value,
                    "demonstration": [{"role": "assistant", "content": expr}, {"role": "tool", "content": value},
                                      {"role": "assistant", "content": value}]})
    rng.shuffle(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-data", required=True, type=Path, help="directory for calculator_{train,eval}.jsonl")
    args = ap.parse_args()
    rng = random.Random(0)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    sets = {"calculator_eval.jsonl": problems(pairs[:128], rng),
            "calculator_train.jsonl": problems(pairs[128:1152], rng)}
    args.write_data.mkdir(parents=True, exist_ok=True)
    for name, rows in sets.items():
        (args.write_data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{args.write_data / name}: {len(rows)} problems")


if __name__ == "__main__":
    main()
