"""Prompts and answers (the arithmetic task, or JSONL / Parquet datasets), prompt rendering through the checkpoint's
tokenizer and chat template, and verifiable rewards (built-in or a user function).

Every bad input is an error at load, before any compute, naming the file, row and field."""

from __future__ import annotations

import random
import re
import string
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_pdm._jsonl import read_jsonl
from megatron_pdm._userfn import load_function
from megatron_pdm.models.tokenizer import Tokenizer

# the tokenizer the arithmetic task ships (scripts/build_arithmetic_tokenizer.py): a byte-level BPE, ChatML template
ARITHMETIC_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "arithmetic_tokenizer"
DATASET_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Problem:
    """prompt: text (one user message when rendered with a chat template) or a list of {role, content} messages;
    answer: the reference the reward compares with; metadata: the whole record, for custom rewards; source:
    `file:row` for error messages."""

    prompt: str | tuple[dict, ...]
    answer: str
    metadata: dict = field(default_factory=dict, compare=False)
    source: str = ""


ARITHMETIC_PROMPT = "{a}+{b}="


def check_arithmetic_prompt(prompt) -> None:
    """data.arithmetic_prompt: a string whose only fields are {a} and {b}, each at least once."""
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(prompt) if f is not None] if isinstance(prompt, str) \
            else None
    except ValueError as e:
        raise ValueError(f"data.arithmetic_prompt: {prompt!r} is not a format string ({e})") from None
    if names is None or sorted(set(names)) != ["a", "b"]:
        raise ValueError(f"data.arithmetic_prompt: expected a string with the fields {{a}} and {{b}} and no others, "
                         f"got {prompt!r}")


def arithmetic_problems(n: int, *, max_operand: int, seed: int, prompt: str = ARITHMETIC_PROMPT) -> list[Problem]:
    """prompt.format(a=a, b=b) (default `a+b=`) with a, b uniform in [0, max_operand]; answer the decimal sum. The
    draws do not depend on the prompt's wording."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        out.append(Problem(prompt.format(a=a, b=b), str(a + b), source=f"arithmetic:{i}"))
    return out


# ---------------------------------------------------------------------------------------------- datasets


def _get(record, key: str):
    """record[a][b] for key "a.b"; KeyError naming the first missing part."""
    value = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(part)
        value = value[part]
    return value


def _read_records(path: Path, top_keys: tuple[str, ...]) -> list[tuple[int, object]]:
    """(row number, record): JSON lines numbered from 1 (blank lines skipped), Parquet rows from 0."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 - pyarrow's errors vary; name the file
            raise ValueError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        for key in top_keys:
            if key not in table.column_names:
                raise ValueError(f"{path}: no column {key!r} (columns: {', '.join(table.column_names)})")
        return list(enumerate(table.to_pylist()))
    return read_jsonl(path)


def _prompt(value, where: str, key: str) -> str | tuple[dict, ...]:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: field {key!r} is an empty prompt")
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: field {key!r} must be a non-empty string or a non-empty list of {{role, content}} "
                         f"messages, got {type(value).__name__} {str(value)[:60]!r}")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: field {key!r} message {i} is not an object: {str(m)[:60]!r}")
        for name in ("role", "content"):
            if not isinstance(m.get(name), str):
                raise ValueError(f"{where}: field {key!r} message {i} has no string {name!r}: {str(m)[:80]!r}")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def load_dataset(path, *, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Problem]:
    """Problems from a JSON-lines (.jsonl, .json) or Parquet (.parquet) file. prompt_key / answer_key are dotted
    paths into nested records (verl's layout: prompt = messages, answer under `reward_model.ground_truth`).
    A prompt is a string or a list of {role, content} messages; an answer is a string or a number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such dataset file")
    if path.suffix not in DATASET_SUFFIXES:
        raise ValueError(f"{path}: unknown dataset format {path.suffix!r}; expected one of {DATASET_SUFFIXES}")
    problems = []
    for row, rec in _read_records(path, (prompt_key.split(".")[0], answer_key.split(".")[0])):
        where = f"{path}:{row}"
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        values = {}
        for name, key in (("prompt", prompt_key), ("answer", answer_key)):
            try:
                values[name] = _get(rec, key)
            except KeyError as e:
                raise ValueError(f"{where}: missing field {key!r} (no {e.args[0]!r}; data.{name}_key)") from None
        answer = values["answer"]
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: field {answer_key!r} must be a string or a number, got {answer!r}")
        problems.append(Problem(_prompt(values["prompt"], where, prompt_key), str(answer), rec, where))
    if not problems:
        raise ValueError(f"{path}: no records")
    return problems


def render_prompt(tokenizer: Tokenizer, problem: Problem, *, chat_template: bool, system_prompt: str | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
    """Prompt token ids. chat_template: `apply_chat_template(messages, add_generation_prompt=True)` of the
    message list (a string prompt is one user message), after the system prompt unless the list has a system
    message of its own; else the text itself (a message list is then an error)."""
    if not chat_template:
        if not isinstance(problem.prompt, str):
            raise ValueError(f"{problem.source}: a message-list prompt needs data.chat_template: true")
        return tokenizer.encode(problem.prompt)
    messages = [{"role": "user", "content": problem.prompt}] if isinstance(problem.prompt, str) \
        else list(problem.prompt)
    if system_prompt and not any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.render_chat(messages, **(template_kwargs or {}))
    return tokenizer.encode(text, special=False)  # the template carries its own special tokens


@dataclass
class PromptSet:
    """Problems and their rendered prompt token ids (same order)."""

    problems: list[Problem]
    prompt_ids: list[list[int]]


@dataclass
class RLData:
    """What the RL loop reads: the tokenizer, the training prompts, the evaluation sets (name -> prompts; "" for
    the default set, logged as eval/reward alone), how many overlong prompts were dropped per set, and the warm
    start's target of each training prompt (data.warm_start_key: response ids and which of them train; None:
    the answers)."""

    tokenizer: Tokenizer
    train: PromptSet
    evals: dict[str, PromptSet]
    skipped: dict[str, int]
    demonstrations: list[tuple[list[int], list[bool]]] | None = None


def demonstration(tokenizer: Tokenizer, value, where: str, template_kwargs: dict | None = None,
                  key: str = "data.warm_start_key") -> tuple[list[int], list[bool]]:
    """The response a warm-start record demonstrates, as ids and which of them train: a text is one assistant
    turn (its tokens and EOS); a list of {role, content} messages is the turns after the prompt, starting and
    ending with the assistant's: assistant turns are their content and EOS (trained), every run of other turns (a
    tool's reply) is rendered as the chat template does between two assistant turns (`Tokenizer.turn_ids`; not
    trained), as a multi-turn rollout holds them."""
    if isinstance(value, str):
        ids = tokenizer.encode(value, special=False) + [tokenizer.eos_id]
        return ids, [True] * len(ids)
    turns = _prompt(value, where, key)
    if turns[0]["role"] != "assistant" or turns[-1]["role"] != "assistant":
        raise ValueError(f"{where}: field {key!r} (data.warm_start_key): a demonstration's turns must start and end "
                         f"with the assistant's, got roles {[m['role'] for m in turns]}")
    ids, flags, others = [], [], []
    for m in turns:
        if m["role"] != "assistant":
            others.append(m)
            continue
        if others:
            reply = tokenizer.turn_ids(others, **(template_kwargs or {}))
            ids, flags, others = ids + reply, flags + [False] * len(reply), []
        own = tokenizer.encode(m["content"], special=False) + [tokenizer.eos_id]
        ids, flags = ids + own, flags + [True] * len(own)
    return ids, flags


def _prompt_set(name: str, problems: list[Problem], tokenizer: Tokenizer, d) -> tuple[PromptSet, int]:
    kept, ids = [], []
    for p in problems:
        x = render_prompt(tokenizer, p, chat_template=d.chat_template, system_prompt=d.system_prompt,
                          template_kwargs=d.chat_template_kwargs)
        if len(x) > d.max_prompt_length:
            if d.overlong_prompt == "error":
                raise ValueError(f"data.max_prompt_length: {d.max_prompt_length} tokens, but {name} prompt "
                                 f"{p.source} has {len(x)} (data.overlong_prompt: skip drops such prompts)")
            continue
        kept.append(p)
        ids.append(x)
    if not kept:
        raise ValueError(f"data.max_prompt_length: every {name} prompt is longer than {d.max_prompt_length} tokens")
    return PromptSet(kept, ids), len(problems) - len(kept)


def load_rl_data(cfg) -> RLData:
    """Tokenizer (cfg.tokenizer_path, checked against model.vocab_size), training and evaluation prompts, rendered
    and length-checked: every bad input fails here, before a model is built."""
    from megatron_pdm.models.tokenizer import load_tokenizer

    d, t = cfg.data, cfg.train
    tokenizer = load_tokenizer(cfg.tokenizer_path, embedding_rows=cfg.model.vocab_size,
                               field="train.init_path" if cfg.model.tokenizer is None and cfg.train.init == "hf"
                               else "model.tokenizer")
    if d.chat_template and not tokenizer.has_chat_template:
        raise ValueError(f"data.chat_template: true, but the tokenizer in {str(tokenizer.path)!r} has no chat "
                         "template")
    if d.task == "arithmetic":
        train = arithmetic_problems(4096, max_operand=d.max_operand, seed=t.seed, prompt=d.arithmetic_prompt)
        default_eval = arithmetic_problems(t.eval_prompts, max_operand=d.max_operand, seed=t.seed + 1,
                                           prompt=d.arithmetic_prompt)
    else:
        train = load_dataset(d.train_path, prompt_key=d.prompt_key, answer_key=d.answer_key)
        default_eval = train[: t.eval_prompts]
    sets = {name: load_dataset(path, prompt_key=d.prompt_key, answer_key=d.answer_key)[: t.eval_prompts]
            for name, path in d.eval_paths.items()} or {"": default_eval}
    skipped = {}
    train_set, skipped["train"] = _prompt_set("train", train, tokenizer, d)
    evals = {}
    for name, problems in sets.items():
        evals[name], skipped[name or "eval"] = _prompt_set(name or "eval", problems, tokenizer, d)
    demos = None
    if d.warm_start_key is not None:
        demos = []
        for p in train_set.problems:
            try:
                value = _get(p.metadata, d.warm_start_key)
            except KeyError as e:
                raise ValueError(f"{p.source}: missing field {d.warm_start_key!r} (no {e.args[0]!r}; "
                                 "data.warm_start_key)") from None
            demos.append(demonstration(tokenizer, value, p.source, d.chat_template_kwargs, d.warm_start_key))
            if len(demos[-1][0]) > cfg.rollout.max_new_tokens:
                raise ValueError(f"{p.source}: field {d.warm_start_key!r} demonstrates a response of "
                                 f"{len(demos[-1][0])} tokens, more than rollout.max_new_tokens = "
                                 f"{cfg.rollout.max_new_tokens}")
    return RLData(tokenizer, train_set, evals, skipped, demos)


# ---------------------------------------------------------------------------------------------- rewards


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_number_reward(response: str, answer: str, metadata: dict | None = None) -> float:
    """1 if the first number in the response equals the answer numerically, else 0."""
    m = _NUMBER.search(response)
    if m is None:
        return 0.0
    try:
        return float(abs(float(m.group()) - float(answer)) < 1e-9)
    except ValueError:
        return float(m.group() == answer.strip())


def last_number_reward(response: str, answer: str, metadata: dict | None = None) -> float:
    """1 if the last number in the response equals the answer numerically, else 0: for a chatty model that states
    the sum after restating the question ("12 + 13 = 25"), where the first number is an operand. (math_verify
    rewards a bare restated "12+13", which it evaluates.)"""
    numbers = _NUMBER.findall(response)
    return exact_number_reward(numbers[-1], answer) if numbers else 0.0


def math_verify_reward(response: str, answer: str, metadata: dict | None = None) -> float:
    """1 if math-verify judges the response equivalent to the answer (LaTeX or plain), else 0. Its timeouts use
    SIGALRM, which only the main thread may set: on another thread (an off-policy schedule's producer) it runs
    without them (responses are bounded by rollout.max_new_tokens), else every call would fail and score 0."""
    from math_verify import parse, verify

    limit = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        return float(verify(parse(answer, parsing_timeout=limit), parse(response, parsing_timeout=limit),
                            timeout_seconds=limit))
    except Exception:  # noqa: BLE001 - an unparsable response earns no reward
        return 0.0


REWARD_FUNCTIONS = {"exact_number": exact_number_reward, "last_number": last_number_reward,
                    "math_verify": math_verify_reward}
RewardFn = Callable[[str, str, dict], float]


def load_reward(spec: str) -> RewardFn:
    """A built-in reward by name, or a user function (`load_function`) with signature (response: str, answer: str,
    metadata: dict) -> float."""
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    if spec.count(":") != 1:
        raise ValueError(f"data.reward: {spec!r} is neither a built-in ({', '.join(REWARD_FUNCTIONS)}) nor "
                         "'package.module:function' / 'file.py:function'")
    return load_function(spec, "data.reward")


def sample_name(response: str, problem: Problem, sample: int) -> str:
    """How a reward error names the sample: its index, its prompt's source, the response's start."""
    return f"data.reward: sample {sample} (prompt {problem.source or '?'}, response {response[:80]!r})"


# float32's largest value: the rewards tensor's dtype (train/rollouts.py), where a larger finite reward would be inf
REWARD_MAX = 3.4028234663852886e38
REWARD_RANGE = "rewards are float32: finite, |reward| <= 3.4e38"


def finite_reward(value) -> float | None:
    """A reward as a float, or None when it is not one: anything with __float__ (a bool is 1.0 / 0.0, numpy's
    scalars, a one-element tensor) but a string, finite and within float32's range. The one conversion of every
    reward (`score`; the remote reward's `reward_value`): an integer too large for a float (a 401-digit one) is
    None here, not an OverflowError out of the run."""
    convert = None if isinstance(value, str | bytes) else getattr(value, "__float__", None)
    try:
        number = float(convert()) if convert is not None else None
    except (TypeError, ValueError, RuntimeError, OverflowError):  # a tensor of several elements; an int too large
        return None
    return number if number is not None and abs(number) <= REWARD_MAX else None  # NaN compares False


def shown_value(value) -> str:
    """A reward's repr for an error, cut to 200 characters; an integer too long for repr (Python's 4300-digit limit)
    by its size."""
    try:
        return repr(value)[:200]
    except ValueError:
        return f"an integer of {value.bit_length()} bits"


def score(fn: RewardFn, response: str, problem: Problem, sample: int) -> float:
    """fn(response, answer, metadata) as a finite float (`finite_reward`); anything else is an error naming the
    sample."""
    where = sample_name(response, problem, sample)
    try:
        value = fn(response, problem.answer, problem.metadata)
    except Exception as e:  # noqa: BLE001 - the user's function failed: name the sample
        raise ValueError(f"{where}: the reward function raised {type(e).__name__}: {e}") from e
    number = finite_reward(value)
    if number is None:
        raise ValueError(f"{where}: the reward must be a finite number, got {shown_value(value)} ({REWARD_RANGE})")
    return number
