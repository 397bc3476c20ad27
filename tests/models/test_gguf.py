"""`megatron-pdm from-gguf` (models/gguf.py): a GGUF file written here with the `gguf` package, as llama.cpp lays
out a Llama-family model (SmolLM2's: tied embeddings, q / k rows in llama.cpp's rotary order, a byte-level BPE
tokenizer with ChatML control tokens and its chat template), becomes an HF checkpoint whose weights, tokenizer and
template are the ones written, and which the trainer's own loaders read."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_pdm.models import ModelConfig, canonical_hf_state, load_hf_checkpoint
from megatron_pdm.train.data import ARITHMETIC_TOKENIZER
from tests.helpers import hf_model

gguf = pytest.importorskip("gguf")

# SmolLM2-135M's shape, shrunk: Llama layout, GQA, tied embeddings, rope base 100000; the arithmetic task's
# tokenizer (288 ids, byte-level BPE, ChatML)
TINY_LLAMA = ModelConfig(model_type="llama", vocab_size=288, hidden_size=32, num_layers=2, num_attention_heads=4,
                         num_query_groups=2, head_dim=8, ffn_hidden_size=48, max_position_embeddings=64,
                         rope_theta=100000.0, tie_word_embeddings=True)


def _llama_cpp_rotary_order(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's q / k rows [heads x (2, d/2), ...] in llama.cpp's order [heads x (d/2, 2), ...] (the inverse of what
    transformers undoes when it reads a llama GGUF)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, cfg: ModelConfig, state: dict, tokenizer_dir: Path) -> None:
    """A float32 llama GGUF of `state` (HF names) with `tokenizer_dir`'s byte-level BPE tokenizer."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    template = (tokenizer_dir / "chat_template.jinja").read_text()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-smollm2-like")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.ffn_hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_query_groups)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # the split regex the merges were learned with (single digits)
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # 3: control, 1: normal
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_chat_template(template)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm":
                 "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_layers):
        for hf, g in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{g}.weight"
    for key, name in names.items():
        t = state[key].numpy().astype(np.float32)
        if ".attn_q." in name:
            t = _llama_cpp_rotary_order(t, cfg.num_attention_heads)
        elif ".attn_k." in name:
            t = _llama_cpp_rotary_order(t, cfg.num_query_groups)
        w.add_tensor(name, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    state = canonical_hf_state(hf_model(TINY_LLAMA, seed=3).state_dict())
    path = tmp_path_factory.mktemp("gguf") / "tiny-Q.gguf"
    write_gguf(path, TINY_LLAMA, state, ARITHMETIC_TOKENIZER)
    return path, state


def test_gguf_becomes_the_checkpoint_it_was_written_from(tiny_gguf, tmp_path):
    from megatron_pdm.cli import main
    from megatron_pdm.models.tokenizer import load_tokenizer

    path, state = tiny_gguf
    out = tmp_path / "hf"
    assert main(["from-gguf", str(path), "--to", str(out)]) == 0
    loaded, cfg = load_hf_checkpoint(out)
    assert (cfg.model_type, cfg.vocab_size, cfg.num_layers, cfg.num_query_groups, cfg.head_dim, cfg.rope_theta,
            cfg.tie_word_embeddings) == ("llama", 288, 2, 2, 8, 100000.0, True)
    expected = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied: the embedding's tensor
    assert set(loaded) == set(expected)
    for key, value in expected.items():  # float32 in, float32 out: bitwise, q / k back in HF's rotary order
        assert torch.equal(loaded[key], value), key
    ours, theirs = load_tokenizer(out), load_tokenizer(ARITHMETIC_TOKENIZER)
    chat = [{"role": "user", "content": "3+4="}]
    assert ours.hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    for text in ("3+4=", "<|im_start|>user\n12+7=<|im_end|>\n", "17"):
        assert ours.hf.encode(text, add_special_tokens=False) == theirs.hf.encode(text, add_special_tokens=False)
    assert ours.eos_id == theirs.eos_id


def test_from_gguf_refuses_in_one_line(tiny_gguf, tmp_path, capsys):
    from megatron_pdm.cli import main

    path, _ = tiny_gguf
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04")
    (tmp_path / "taken").mkdir()
    for args, message in (([str(tmp_path / "none.gguf")], "is not a file"), ([str(not_gguf)], "is not a GGUF file"),
                          ([str(path), "--to", str(tmp_path / "taken")], "exists (--force replaces it)")):
        argv = ["from-gguf", *args] + ([] if "--to" in args else ["--to", str(tmp_path / "out")])
        assert main(argv) == 2
        assert message in capsys.readouterr().err


def test_a_run_starts_from_the_converted_checkpoint(tiny_gguf, tmp_path, dist_pools):
    """The SmolLM2 example's config (examples/smollm2_addition.yaml: no model section, bf16 rollouts, the addition
    task worded for a chat model, the last-number reward) from a converted directory: the trainer reads the
    architecture from it, loads it and trains a step."""
    import math

    from megatron_pdm.models.gguf import hf_checkpoint_from_gguf
    from megatron_pdm.train.config import load_config
    from tests.helpers import ROOT, rank_train

    path, _ = tiny_gguf
    out = hf_checkpoint_from_gguf(path, tmp_path / "hf")
    cfg = load_config(ROOT / "examples" / "smollm2_addition.yaml",
                      [f"train.init_path={out}", "train.steps=1", "train.eval_prompts=4", "train.prompts_per_step=2",
                       "train.micro_batch_size=4", "rollout.max_new_tokens=4"])
    assert cfg.model.model_type == "llama" and cfg.model.vocab_size == TINY_LLAMA.vocab_size
    rows, _ = dist_pools(1).run(rank_train, shared=(cfg, tmp_path / "run"))[0]
    assert [r["step"] for r in rows] == [0, 1] and math.isfinite(rows[-1]["train/loss"])


def test_from_gguf_force_never_deletes_what_holds_its_input(tiny_gguf, tmp_path, monkeypatch, capsys):
    """--to with --force (which deletes it first) may not be, or hold, the GGUF file, the current directory, the
    home directory or /, symlinks resolved, nor may its staging directory (deleted without --force): one line
    naming what it holds, before anything is read, and every file as it was (the regression: `--to` an ancestor of
    the GGUF file deleted it and everything beside it)."""
    import shutil

    from megatron_pdm.cli import main

    models = tmp_path / "models"
    gguf_file = models / "sub" / "tiny.gguf"
    gguf_file.parent.mkdir(parents=True)
    shutil.copy(tiny_gguf[0], gguf_file)
    (models / "notes.txt").write_text("the user's other files\n")
    (tmp_path / "link").symlink_to(models, target_is_directory=True)
    (tmp_path / "home" / "me").mkdir(parents=True)
    (tmp_path / "work" / ".hf.from-gguf").mkdir(parents=True)
    (tmp_path / "work" / "deep").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home" / "me"))
    files = lambda: {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}  # noqa: E731
    before = files()
    work = tmp_path / "work"
    for cwd, out, why in ((tmp_path, models, f"contains the GGUF file {gguf_file}"),
                          (tmp_path, gguf_file.parent, f"contains the GGUF file {gguf_file}"),
                          (tmp_path, tmp_path / "link", f"contains the GGUF file {gguf_file}"),
                          (tmp_path, tmp_path / "home", f"contains the home directory {tmp_path / 'home' / 'me'}"),
                          (work, work, f"is the current directory {work}"),
                          (work, Path("/"), f"contains the GGUF file {gguf_file}"),
                          (work / "deep", work, f"contains the current directory {work / 'deep'}"),
                          (work / ".hf.from-gguf", work / "hf", "staging directory")):
        monkeypatch.chdir(cwd)
        assert main(["from-gguf", str(gguf_file), "--to", str(out), "--force"]) == 2, out
        err = capsys.readouterr().err
        assert err.startswith(f"from-gguf: --to {out}") and why in err and err.count("\n") == 1, (out, err)
        assert files() == before, out


def test_from_gguf_force_replaces_a_symlink_not_its_target(tiny_gguf, tmp_path):
    """--to a symlink, with --force: the link is replaced by the checkpoint, the directory it pointed to is kept
    (it was an error: rmtree refuses a symlink, after the whole conversion)."""
    from megatron_pdm.cli import main

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep.txt").write_text("kept\n")
    (tmp_path / "hf").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert main(["from-gguf", str(tiny_gguf[0]), "--to", str(tmp_path / "hf"), "--force"]) == 0
    assert not (tmp_path / "hf").is_symlink() and (tmp_path / "hf" / "config.json").is_file()
    assert [p.name for p in (tmp_path / "elsewhere").iterdir()] == ["keep.txt"]
    assert not (tmp_path / ".hf.from-gguf").exists()
