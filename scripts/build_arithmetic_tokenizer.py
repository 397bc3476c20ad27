"""Train the arithmetic task's tokenizer: a small byte-level BPE (HF `tokenizers`) with a ChatML-style template.

    python scripts/build_arithmetic_tokenizer.py   # rewrites megatron_pdm/assets/arithmetic_tokenizer/

Byte-level: the 256 byte symbols are the base alphabet, so any UTF-8 text encodes; digits are split one by one
(the Qwen2 / Qwen3 pre-tokenizer rule), and the merges are learnt from every `a+b=` problem of the task rendered
with the template. Three special tokens: <|endoftext|> (padding), <|im_start|>, <|im_end|> (end of a turn: EOS).
The result is deterministic (same files for the same tokenizers version).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from megatron_pdm.models.tokenizer import QWEN_PRETOKENIZE_PATTERN, chatml_template, save_chatml_tokenizer

OUT = Path(__file__).resolve().parents[1] / "megatron_pdm" / "assets" / "arithmetic_tokenizer"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus(max_operand: int = 99):
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            yield f"<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n{a}+{b}=<|im_end|>\n" \
                  f"<|im_start|>assistant\n{a + b}<|im_end|>\n"


def build(out: Path = OUT, vocab_size: int = 288) :
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_PATTERN), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                 use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    hf = save_chatml_tokenizer(tok, out, chat_template=chatml_template(), model_max_length=4096)
    return hf


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    hf = build(args.out)
    print(f"wrote {args.out}: {len(hf)} ids")
