"""The checkpoint's own tokenizer: a `transformers` tokenizer loaded from local files, with the ids the RL loop needs.

A tokenizer directory holds what `save_pretrained` writes (`tokenizer.json`, `tokenizer_config.json`, optionally
`chat_template.jinja`) and, as HF checkpoints do, `generation_config.json`, whose `eos_token_id` (an id or a list)
adds stop ids: Qwen3 stops on `<|im_end|>` and on `<|endoftext|>`.

The model's embedding may have more rows than the tokenizer has ids (Qwen3: 151,669 ids, 151,936 rows; megatron
pads the vocabulary to a multiple of 128 x TP). Engines sample over every row, as megatron and SGLang do; ids
past the tokenizer are no text, so `decode` drops them. A tokenizer larger than the embedding is an error.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# what a tokenizer directory may hold, besides the weights (copied into every HF export, so engines can load it)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "generation_config.json")


def has_tokenizer(directory) -> bool:
    d = Path(directory)
    return (d / "tokenizer.json").is_file() or (d / "tokenizer.model").is_file() or (d / "vocab.json").is_file()


@dataclass(frozen=True)
class Tokenizer:
    """hf: the transformers tokenizer; vocab_size = len(hf) (ids in [0, vocab_size) are text or special tokens);
    eos_id ends a warm-start answer; stop_ids end a sampled response (eos_id first); pad_id fills padding."""

    path: Path
    hf: Any
    vocab_size: int
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...]

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of `text`; special: add the tokenizer's own BOS / EOS decoration, if it has any."""
        return list(self.hf(text, add_special_tokens=special)["input_ids"])

    def render_chat(self, messages: list[dict], **template_kwargs) -> str:
        """`apply_chat_template(messages, add_generation_prompt=True)` as text (it carries its own specials)."""
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)

    def turn_ids(self, messages: list[dict], **template_kwargs) -> list[int]:
        """Token ids of `messages` (e.g. one {"role": "tool", "content": ...}) as the chat template renders them
        after an assistant turn the policy ended with its stop token, through the generation prompt of the next
        assistant turn: what the context holds between two of the policy's turns. Read off one rendering of
        [user, assistant, *messages] with the generation prompt: the text after the assistant's content, less the
        end token the policy generated (ChatML: "\\n<|im_start|>tool\\n...<|im_end|>\\n<|im_start|>assistant\\n").
        ValueError if the template does not close the assistant's content with the EOS token."""
        marker = "\u2063assistant-content\u2063"
        text = self.hf.apply_chat_template([{"role": "user", "content": "?"}, {"role": "assistant", "content": marker},
                                            *messages], tokenize=False, add_generation_prompt=True, **template_kwargs)
        after = text[text.index(marker) + len(marker):]
        eos = self.hf.convert_ids_to_tokens(self.eos_id)
        if not after.startswith(eos):
            raise ValueError(f"the chat template in {str(self.path)!r} does not end an assistant turn with the EOS "
                             f"token {eos!r} (it writes {after[:40]!r}): a tool turn cannot follow the policy's")
        return self.encode(after[len(eos):], special=False)

    def decode(self, ids) -> str:
        """Text of `ids` without special tokens; ids past the tokenizer (embedding padding) are dropped."""
        return self.hf.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=True)


def _generation_config(directory: Path) -> dict:
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def token_id_list(value) -> list[int]:
    """An HF config's token-id field (`eos_token_id`, `pad_token_id`: absent, an id or a list of ids) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def load_tokenizer(directory, *, embedding_rows: int | None = None, field: str = "model.tokenizer") -> Tokenizer:
    """The tokenizer in `directory` (local files only, never a hub). embedding_rows: the model's vocabulary; a
    tokenizer with more ids is an error naming both sizes. `field` names the config key in errors."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{field}: {str(directory)!r} is not a directory")
    if not has_tokenizer(directory):
        raise FileNotFoundError(f"{field}: {str(directory)!r} holds no tokenizer (tokenizer.json, tokenizer.model "
                                "or vocab.json)")
    try:
        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; say where it came from
        raise ValueError(f"{field}: cannot load the tokenizer in {str(directory)!r}: {type(e).__name__}: {e}") from e
    size = len(hf)
    if embedding_rows is not None and size > embedding_rows:
        raise ValueError(f"{field}: the tokenizer in {str(directory)!r} has {size} ids, more than the model's "
                         f"{embedding_rows} embedding rows (model.vocab_size)")
    gen = _generation_config(directory)
    eos = token_id_list(hf.eos_token_id) + token_id_list(gen.get("eos_token_id"))
    if not eos:
        raise ValueError(f"{field}: the tokenizer in {str(directory)!r} has no EOS token (neither its eos_token nor "
                         "generation_config.json's eos_token_id)")
    pad = hf.pad_token_id if hf.pad_token_id is not None else (token_id_list(gen.get("pad_token_id")) or eos)[0]
    stop = tuple(dict.fromkeys(eos))
    for i in (*stop, pad):
        if not 0 <= i < size:
            raise ValueError(f"{field}: special token id {i} of {str(directory)!r} is outside its {size} ids")
    return Tokenizer(directory, hf, size, stop[0], pad, stop)


def copy_tokenizer_files(src, dst) -> None:
    """Copy the tokenizer files of directory `src` into `dst` (an HF export), so engines load the same tokenizer."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, dst / name)


# Qwen2 / Qwen3's pre-tokenizer split: letters with an optional leading symbol, single digits, punctuation runs,
# newlines, spaces (the byte-level BPEs that scripts/ and examples/ build use it)
QWEN_PRETOKENIZE_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
                            r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def chatml_template(*, thinking_switch: bool = False) -> str:
    """A ChatML chat template of our own: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, and
    `<|im_start|>assistant\\n` as the generation prompt; thinking_switch: Qwen3's `enable_thinking=False` opens
    the answer with an empty `<think>\\n\\n</think>\\n\\n`."""
    think = ("{%- if enable_thinking is defined and enable_thinking is false %}"
             "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}") if thinking_switch else ""
    return ("{%- for message in messages %}"
            "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}" + think + "{%- endif %}")


def save_chatml_tokenizer(tokenizer_object, out, *, chat_template: str, model_max_length: int):
    """Save a `tokenizers` byte-level BPE with <|im_end|> as EOS and <|endoftext|> as padding (save_pretrained)
    and a generation_config.json that stops on both, as Qwen3's checkpoints do. Returns the transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", chat_template=chat_template,
                                 model_max_length=model_max_length)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    eos = [hf.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": eos[1]}, indent=2)
                                                 + "\n")
    return hf
