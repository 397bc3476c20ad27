"""Prompts, answers, a character tokenizer made locally, and verifiable rewards."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_pdm._jsonl import read_jsonl

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHARS = "0123456789+-*=?. abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """One token per character of CHARS plus <pad>, <bos>, <eos>; the ids are fixed, so no file is needed."""

    def __init__(self):
        self.itos = [PAD, BOS, EOS] + list(CHARS)
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        bad = sorted({c for c in text.lower() if c not in self.stoi})
        if bad:
            raise ValueError(f"tokenizer: characters {bad} are not in the vocabulary {CHARS!r}")
        return ([self.bos_id] if bos else []) + [self.stoi[c] for c in text.lower()]

    def decode(self, ids) -> str:
        """Text of the character tokens; special tokens and ids past the vocabulary (the model's vocabulary is
        padded to a multiple of TP) decode to nothing."""
        n = len(self.itos)
        return "".join(self.itos[i] for i in ids if self.eos_id < i < n)

    def save(self, directory) -> None:
        """A `tokenizer.json` (HF tokenizers WordLevel over characters) so HF-serving engines can load it."""
        from tokenizers import Tokenizer, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(self.itos)}, unk_token=PAD))
        tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        Path(directory).mkdir(parents=True, exist_ok=True)
        tok.save(str(Path(directory) / "tokenizer.json"))


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def arithmetic_problems(n: int, *, max_operand: int, seed: int) -> list[Problem]:
    """`a+b=` with a, b uniform in [0, max_operand]; answer the decimal sum."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        out.append(Problem(f"{a}+{b}=", str(a + b)))
    return out


def load_jsonl(path) -> list[Problem]:
    """Records {"prompt": str, "answer": str | number}; a malformed record is an error naming file, line, field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such dataset file")
    out = []
    for lineno, rec in read_jsonl(path):
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        for name in ("prompt", "answer"):
            if name not in rec:
                raise ValueError(f"{path}:{lineno}: missing field {name!r}")
        if not isinstance(rec["prompt"], str) or not rec["prompt"]:
            raise ValueError(f"{path}:{lineno}: field 'prompt' must be a non-empty string")
        if not isinstance(rec["answer"], (str, int, float)) or isinstance(rec["answer"], bool):
            raise ValueError(f"{path}:{lineno}: field 'answer' must be a string or a number")
        out.append(Problem(rec["prompt"], str(rec["answer"])))
    if not out:
        raise ValueError(f"{path}: no records")
    return out


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_number_reward(response: str, answer: str) -> float:
    """1 if the first number in the response equals the answer numerically, else 0."""
    m = _NUMBER.search(response)
    if m is None:
        return 0.0
    try:
        return float(abs(float(m.group()) - float(answer)) < 1e-9)
    except ValueError:
        return float(m.group() == answer.strip())


def math_verify_reward(response: str, answer: str) -> float:
    """1 if math-verify judges the response equivalent to the answer (LaTeX or plain), else 0."""
    from math_verify import parse, verify

    try:
        return float(verify(parse(answer), parse(response)))
    except Exception:  # noqa: BLE001 - an unparsable response earns no reward
        return 0.0


REWARD_FUNCTIONS = {"exact_number": exact_number_reward, "math_verify": math_verify_reward}
