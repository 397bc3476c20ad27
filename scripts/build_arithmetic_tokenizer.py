"""Train the arithmetic task's tokenizer: a small byte-level BPE (HF `tokenizers`) with a ChatML-style template.

    python scripts/build_arithmetic_tokenizer.py   # rewrites megatron_pdm/assets/arithmetic_tokenizer/

Byte-level: the 256 byte symbols are the base alphabet, so any UTF-8 text encodes; digits are split one by one
(the Qwen2 / Qwen3 pre-tokenizer rule), and the merges are learnt from every `a+b=` problem of the task rendered
with the template. Three special tokens: <|endoftext|> (padding), <|im_start|>, <|im_end|> (end of a turn: EOS).
The result is deterministic (same files for the same tokenizers version).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parents[1] / "megatron_pdm" / "assets" / "arithmetic_tokenizer"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2 / Qwen3's split: letters with an optional leading symbol, single digits, punctuation runs, newlines, spaces
PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
           r"""|\s+(?!\S)|\s+""")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def corpus(max_operand: int = 99):
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            yield f"<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n{a}+{b}=<|im_end|>\n" \
                  f"<|im_start|>assistant\n{a + b}<|im_end|>\n"


def build(out: Path = OUT, vocab_size: int = 288) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 chat_template=CHAT_TEMPLATE, model_max_length=4096)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    ids = [hf.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids, "pad_token_id": ids[1]}, indent=2)
                                                 + "\n")
    return hf


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    hf = build(args.out)
    print(f"wrote {args.out}: {len(hf)} ids")
