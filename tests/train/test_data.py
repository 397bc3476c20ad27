"""Real tokenizers, chat templates, datasets and rewards: the arithmetic task's BPE, Qwen3's vocabulary built offline,
JSONL / Parquet records in verl's layout, user reward functions, and every bad input named at load."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pdm.models import ModelConfig, canonical_hf_state, save_hf_checkpoint
from megatron_pdm.models.tokenizer import copy_tokenizer_files, load_tokenizer
from megatron_pdm.train.config import config_from_dict, load_config
from megatron_pdm.train.data import (
    ARITHMETIC_TOKENIZER,
    Problem,
    exact_number_reward,
    load_dataset,
    load_reward,
    load_rl_data,
    math_verify_reward,
    render_prompt,
    score,
)
from tests.helpers import hf_model

ROOT = Path(__file__).resolve().parents[2]
LATEX = ROOT / "examples" / "data" / "latex_math.jsonl"
TINY = dict(model_type="qwen3", vocab_size=320, hidden_size=32, num_layers=2, num_attention_heads=4,
            num_query_groups=2, head_dim=8, ffn_hidden_size=64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """examples/qwen3_vocab_tiny.py's output: Qwen3's tokenizer from quicktok's ranks + a tiny 151,936-row model."""
    out = tmp_path_factory.mktemp("qwen3")
    subprocess.run([sys.executable, str(ROOT / "examples" / "qwen3_vocab_tiny.py"), "--out", str(out)], check=True,
                   capture_output=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return out


def _cli(args, cwd, monkeypatch):
    """`megatron-pdm ARGS` from this process (its ranks are spawned as the command spawns them; the command's own
    interpreter, 1.7 s of imports, is what the sigkill and Slurm tests run)."""
    from megatron_pdm.cli import main

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(cwd)
    assert main(args) == 0


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_arithmetic_tokenizer_and_chat_rendering():
    tok = load_tokenizer(ARITHMETIC_TOKENIZER, embedding_rows=320)
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.stop_ids) == (288, 2, 0, (2, 0))
    user = Problem("3+4=", "7")
    text = tok.hf.decode(render_prompt(tok, user, chat_template=True))
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    system = tok.hf.decode(render_prompt(tok, user, chat_template=True, system_prompt="Add."))
    assert system == "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    turns = Problem(({"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
                     {"role": "user", "content": "2+2="}), "4")
    # regression: data.system_prompt was silently dropped for message-list prompts; it goes first unless the list
    # has a system message of its own
    assert tok.hf.decode(render_prompt(tok, Problem(({"role": "user", "content": "3+4="},), "7"), chat_template=True,
                                       system_prompt="Add.")) == system
    own = Problem(({"role": "system", "content": "Sum."}, {"role": "user", "content": "3+4="}), "7")
    assert tok.hf.decode(render_prompt(tok, own, chat_template=True, system_prompt="Add.")).startswith(
        "<|im_start|>system\nSum.<|im_end|>\n<|im_start|>user")
    assert tok.hf.decode(render_prompt(tok, turns, chat_template=True)) == (
        "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
        "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n")
    assert render_prompt(tok, user, chat_template=False) == tok.encode("3+4=")
    with pytest.raises(ValueError, match="message-list prompt needs data.chat_template: true"):
        render_prompt(tok, turns, chat_template=False)
    # byte-level: any text round-trips; specials and ids past the tokenizer (embedding padding) decode to nothing
    latex = "Find $\\frac{x^2}{\\sqrt{3}}$ — É 你好"
    assert tok.decode(tok.encode(latex)) == latex
    assert tok.decode(tok.encode("17") + [tok.eos_id, 300, 319]) == "17"


def test_qwen3_vocabulary_built_offline(qwen3_dir):
    import quicktok

    tok = load_tokenizer(qwen3_dir / "checkpoint", embedding_rows=151936)
    assert tok.vocab_size == 151669 and tok.encode("Hello") == [9707]
    assert tok.hf.convert_tokens_to_ids("<|im_end|>") == 151645 and tok.stop_ids == (151645, 151643)
    assert tok.pad_id == 151643
    enc = quicktok.get_encoding("qwen3")  # an independent implementation of the same BPE
    texts = [line for line in LATEX.read_text().splitlines()] + ["Héllo wörld 12345\n\n  x\t 你好 😀 café"]
    assert all(tok.encode(t) == enc.encode(t) for t in texts)
    no_think = tok.render_chat([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert no_think == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    cfg = load_config(ROOT / "examples" / "qwen3_vocab_tiny.yaml",
                      [f"train.init_path={qwen3_dir / 'checkpoint'}", f"data.train_path={LATEX}",
                       "data.chat_template_kwargs={enable_thinking: false}"])
    assert cfg.model.vocab_size == 151936 and cfg.model.tie_word_embeddings  # read from config.json
    data = load_rl_data(cfg)
    assert tok.hf.decode(data.train.prompt_ids[1]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_datasets_jsonl_and_parquet_with_nested_keys(tmp_path, qwen3_dir):
    problems = load_dataset(LATEX, prompt_key="prompt", answer_key="reward_model.ground_truth")
    assert len(problems) == 16 and problems[0].answer == "\\frac{5}{6}" and problems[1].answer == "12"
    assert problems[0].prompt == ({"role": "user", "content": problems[0].metadata["prompt"][0]["content"]},)
    assert isinstance(problems[1].prompt, str) and problems[1].metadata["extra_info"] == {"index": 1}
    parquet = load_dataset(qwen3_dir / "latex_math.parquet", prompt_key="prompt",
                           answer_key="reward_model.ground_truth")
    assert [p.answer for p in parquet] == [p.answer for p in problems]
    assert parquet[1].prompt == ({"role": "user", "content": problems[1].prompt},)
    f = tmp_path / "n.jsonl"
    f.write_text('{"q": {"text": "1+1="}, "a": 2}\n\n{"q": {"text": "2+2="}, "a": "4"}\n')
    assert [(p.prompt, p.answer, p.source) for p in load_dataset(f, prompt_key="q.text", answer_key="a")] == [
        ("1+1=", "2", f"{f}:1"), ("2+2=", "4", f"{f}:3")]


def _bad(tmp_path, text: bytes | str, match, **keys):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=match):
        load_dataset(f, **keys)


def test_bad_inputs_are_named_at_load(tmp_path):
    _bad(tmp_path, '{"prompt": "x", "answer": 1}\n{"question": "y", "answer": 2}\n',
         r"bad.jsonl:2: missing field 'prompt' \(no 'prompt'; data.prompt_key\)")
    _bad(tmp_path, '{"prompt": "x", "reward_model": {}}\n',
         r"bad.jsonl:1: missing field 'reward_model.ground_truth' \(no 'ground_truth'",
         answer_key="reward_model.ground_truth")
    _bad(tmp_path, '{"prompt": "  ", "answer": 1}\n', r"bad.jsonl:1: field 'prompt' is an empty prompt")
    _bad(tmp_path, '{"prompt": [], "answer": 1}\n', r"bad.jsonl:1: field 'prompt' must be a non-empty string")
    _bad(tmp_path, '{"prompt": [{"role": "user"}], "answer": 1}\n',
         r"bad.jsonl:1: field 'prompt' message 0 has no string 'content'")
    _bad(tmp_path, '{"prompt": [{"content": "hi"}], "answer": 1}\n',
         r"bad.jsonl:1: field 'prompt' message 0 has no string 'role'")
    _bad(tmp_path, b'{"prompt": "x", "answer": 1}\n{"prompt": "\xff\xfe", "answer": 1}\n', r"bad.jsonl:2: not UTF-8")
    _bad(tmp_path, '{"prompt": "x", "answer": 1}\n{"prompt": "x"\n', r"bad.jsonl:2: not valid JSON")
    _bad(tmp_path, '{"prompt": "x", "answer": [1]}\n', r"bad.jsonl:1: field 'answer' must be a string or a number")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["1+1="], "answer": ["2"]}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d.parquet: no column 'prompt' \(columns: question, answer\)"):
        load_dataset(tmp_path / "d.parquet")
    with pytest.raises(FileNotFoundError, match="no such dataset file"):
        load_dataset(tmp_path / "missing.jsonl")
    # the tokenizer: missing, without a template, larger than the embedding
    base = {"model": {**TINY}, "data": {"chat_template": True}}
    with pytest.raises(FileNotFoundError, match=r"model.tokenizer: '.*nope' is not a directory"):
        load_rl_data(config_from_dict({**base, "model": {**TINY, "tokenizer": str(tmp_path / "nope")}}))
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the same tokenizer without chat_template.jinja
        (plain / name).write_bytes((ARITHMETIC_TOKENIZER / name).read_bytes())
    with pytest.raises(ValueError, match=r"data.chat_template: true, but the tokenizer in '.*plain' has no chat"):
        load_rl_data(config_from_dict({**base, "model": {**TINY, "tokenizer": str(plain)}}))
    with pytest.raises(ValueError, match=r"has 288 ids, more than the model's 128 embedding rows"):
        load_rl_data(config_from_dict({**base, "model": {**TINY, "vocab_size": 128}}))
    with pytest.raises(ValueError, match=r"data.reward: cannot import 'no_such_module_xyz': ModuleNotFoundError"):
        config_from_dict({"data": {"reward": "no_such_module_xyz:score"}})
    with pytest.raises(ValueError, match="model.tokenizer: required"):
        config_from_dict({"data": {"train_path": str(LATEX)}})


def test_overlong_prompts_error_or_skip(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "' + "1+" * 40 + '1=", "answer": 41}\n')
    d = {"model": {**TINY, "tokenizer": str(ARITHMETIC_TOKENIZER)},
         "data": {"train_path": str(f), "max_prompt_length": 16}}
    with pytest.raises(ValueError, match=rf"data.max_prompt_length: 16 tokens, but train prompt {f}:2 has 82"):
        load_rl_data(config_from_dict(d))
    d["data"]["overlong_prompt"] = "skip"
    data = load_rl_data(config_from_dict(d))
    assert [p.answer for p in data.train.problems] == ["2"] and data.skipped == {"train": 1, "eval": 1}


def test_custom_reward_and_reward_errors(tmp_path, monkeypatch):
    mod = tmp_path / "my_rewards.py"
    mod.write_text("def score(response, answer, metadata):\n"
                   "    return float(response.strip() == answer) + 0.5 * (metadata.get('bonus') or 0)\n"
                   "def broken(response, answer, metadata):\n    raise KeyError('judge')\n"
                   "def nan(response, answer, metadata):\n    return float('nan')\n"
                   "def text(response, answer, metadata):\n    return 'yes'\n"
                   "def match(response, answer, metadata):\n    return response.strip() == answer\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("my_rewards:score")
    assert load_reward(f"{mod}:score")("7", "7", {}) == 1.0  # the file-path form
    p = Problem("3+4=", "7", {"bonus": 1}, "d.jsonl:3")
    assert score(fn, "7", p, 0) == 1.5 and score(fn, "8", p, 0) == 0.5
    with pytest.raises(ValueError, match=r"sample 5 \(prompt d.jsonl:3, response '8'\): the reward function raised "
                                         r"KeyError: 'judge'"):
        score(load_reward("my_rewards:broken"), "8", p, 5)
    with pytest.raises(ValueError, match=r"sample 1 .*: the reward must be a finite number, got nan"):
        score(load_reward("my_rewards:nan"), "8", p, 1)
    with pytest.raises(ValueError, match=r"the reward must be a finite number, got 'yes'"):
        score(load_reward("my_rewards:text"), "8", p, 1)
    # regression: a bool was refused, and only at the first rollout; a bool is a number (as in Python)
    assert score(load_reward("my_rewards:match"), "7", p, 0) == 1.0 and score(load_reward("my_rewards:match"), "8",
                                                                               p, 0) == 0.0
    import numpy as np
    import torch

    for value, expected in ((np.bool_(True), 1.0), (np.float32(0.5), 0.5), (torch.tensor(2.0), 2.0)):
        assert score(lambda r, a, m, v=value: v, "7", p, 0) == expected
    for bad in ("1", torch.tensor([1.0, 2.0]), None, float("inf")):
        with pytest.raises(ValueError, match="the reward must be a finite number"):
            score(lambda r, a, m, v=bad: v, "7", p, 0)
    with pytest.raises(ValueError, match=r"data.reward: 'my_rewards' has no function 'missing'"):
        load_reward("my_rewards:missing")
    (tmp_path / "syntax_err.py").write_text("def f(:\n")
    with pytest.raises(ValueError, match=r"data.reward: cannot import 'syntax_err': SyntaxError"):
        load_reward("syntax_err:f")
    assert exact_number_reward("07.0", "7", {}) == 1.0 and exact_number_reward("8", "7") == 0.0
    assert math_verify_reward("the answer is 0.5", "\\frac{1}{2}") == 1.0 and math_verify_reward("3", "4") == 0.0
    # a chat model restates the sum before it gives it: the last number is its answer (SmolLM2's own replies)
    last = load_reward("last_number")
    assert last("12 + 13 = 25\n\nThis is a classic example.", "25", {}) == 1.0
    assert last("12 + 13 is equal to 24.", "25", {}) == 0.0 and last("12+13", "25", {}) == 0.0
    assert last("no digits", "25", {}) == 0.0 and last("-3.0", "-3", {}) == 1.0
    assert exact_number_reward("12 + 13 = 25", "25") == 0.0  # the first number: the operand
    assert math_verify_reward("12+13", "25") == 1.0  # it evaluates a restated question: not for this task


def test_a_reward_too_large_for_a_float_names_the_sample():
    """A user reward function's 401-digit integer (too large for a float), one too long even to print, or a float
    beyond float32's range (the rewards' dtype, where it would train as inf) is the one-line error naming the sample
    (the regression: an uncaught OverflowError ended the run; 1e39 trained as inf)."""
    import numpy as np

    p = Problem("3+4=", "7", {}, "d.jsonl:3")
    for bad, shown in ((10**400, "1" + "0" * 150), (-(10**400), "-1" + "0" * 150), (1e39, "1e+39"),
                       (np.float64(-1e39), repr(np.float64(-1e39))),
                       (10**5000, "an integer of 16610 bits")):
        with pytest.raises(ValueError, match=r"^data.reward: sample 2 \(prompt d.jsonl:3, response '7'\): the "
                                             rf"reward must be a finite number, got {re.escape(shown)}.* \(rewards are "
                                             "float32"):
            score(lambda r, a, m, v=bad: v, "7", p, 2)
    assert score(lambda r, a, m: 3e38, "7", p, 0) == 3e38  # float32's range holds it


def test_arithmetic_prompt_words_the_task(tmp_path):
    """data.arithmetic_prompt words the addition problems for a chat model; the operands drawn do not change."""
    from megatron_pdm.train.data import arithmetic_problems

    plain = arithmetic_problems(5, max_operand=20, seed=3)
    worded = arithmetic_problems(5, max_operand=20, seed=3, prompt="What is {a} + {b}?")
    for p, w in zip(plain, worded, strict=True):
        a, b = p.prompt.rstrip("=").split("+")
        assert w.prompt == f"What is {a} + {b}?" and w.answer == p.answer == str(int(a) + int(b))
    for bad in ("{a} plus", "{a}+{b}+{c}", "{a}+{b", 7):
        with pytest.raises(ValueError, match=r"^data.arithmetic_prompt: "):
            config_from_dict({"data": {"arithmetic_prompt": bad}})
    with pytest.raises(ValueError, match=r"data.arithmetic_prompt: .* words the arithmetic task; data.task is"):
        config_from_dict({"data": {"train_path": str(LATEX), "arithmetic_prompt": "{a} and {b}"}})


def test_model_section_from_the_checkpoint(tmp_path):
    cfg = ModelConfig(**TINY)
    save_hf_checkpoint(tmp_path, canonical_hf_state(hf_model(cfg).state_dict()), cfg,
                       tokenizer_dir=ARITHMETIC_TOKENIZER)
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "generation_config.json").is_file()
    train = {"init": "hf", "init_path": str(tmp_path)}
    loaded = config_from_dict({"train": train})
    assert loaded.model == cfg and loaded.tokenizer_path == tmp_path
    given = config_from_dict({"train": train, "model": {"hidden_size": 32, "moe_aux_loss_coeff": 0.0}}).model
    assert given == dataclasses.replace(cfg, moe_aux_loss_coeff=0.0)  # a training setting, not the architecture
    with pytest.raises(ValueError, match=r"model: differs from the checkpoint .*config.json: model.hidden_size: 64 "
                                         r"\(checkpoint: 32\); model.num_layers: 3 \(checkpoint: 2\)"):
        config_from_dict({"train": train, "model": {"hidden_size": 64, "num_layers": 3}})
    with pytest.raises(FileNotFoundError, match=r"train.init_path: .*nope/config.json does not exist"):
        config_from_dict({"train": {"init": "hf", "init_path": str(tmp_path / "nope")}})


def test_serve_decodes_with_the_checkpoint_tokenizer(tmp_path):
    from megatron_pdm.rollout.sglang.server import EngineServer

    cfg = ModelConfig(**TINY)
    save_hf_checkpoint(tmp_path, canonical_hf_state(hf_model(cfg).state_dict()), cfg)
    assert EngineServer(str(tmp_path)).tokenizer is None  # no tokenizer files: SGLang's --skip-tokenizer-init
    copy_tokenizer_files(ARITHMETIC_TOKENIZER, tmp_path)
    server = EngineServer(str(tmp_path))
    out = server.generate({"input_ids": [1, 282, 201], "sampling_params": {"max_new_tokens": 6, "sampling_seed": 3},
                           "return_logprob": True})
    assert out["text"] == server.tokenizer.decode(out["output_ids"])
    with pytest.raises(ValueError, match=r"serve --tokenizer: the tokenizer in .* has 288 ids, more than the model's "
                                         r"128 embedding rows"):
        small = ModelConfig(**{**TINY, "vocab_size": 128})
        save_hf_checkpoint(tmp_path / "small", canonical_hf_state(hf_model(small).state_dict()), small,
                           tokenizer_dir=ARITHMETIC_TOKENIZER)
        EngineServer(str(tmp_path / "small"))


@pytest.mark.e2e
def test_qwen3_vocabulary_run_at_tp2(qwen3_dir, tmp_path, monkeypatch):
    """The issue's config as written (no model section), 2 RL steps at TP 2 from the checkpoint directory: trained
    on the Parquet copy with a user reward and wandb offline, evaluated on the JSONL as a named eval set (avg@2).
    (math_verify, the config's reward, is checked on its own in test_custom_reward_and_reward_errors.)"""
    ckpt = qwen3_dir / "checkpoint"
    config = tmp_path / "q.yaml"
    config.write_text((ROOT / "examples" / "qwen3_vocab_tiny.yaml").read_text()
                      .replace("runs/qwen3_vocab_tiny/checkpoint", str(ckpt))
                      .replace("examples/data/latex_math.jsonl", str(LATEX)))
    reward = tmp_path / "length_reward.py"  # a user reward: 1 per response, whatever it says
    reward.write_text("def score(response, answer, metadata):\n"
                      "    assert metadata['data_source'] == 'megatron-pdm/latex-demo'\n    return 1.0\n")
    _cli(["train", "--config", str(config), "--run-dir", str(tmp_path / "parquet"),
          f"data.train_path={qwen3_dir / 'latex_math.parquet'}", f"data.reward={reward}:score", "logging.wandb=true",
          "logging.wandb_mode=offline", "logging.wandb_group=tests", f"data.eval_paths={{latex: {LATEX}}}",
          "train.eval_samples=2"], tmp_path, monkeypatch)
    rows = _rows(tmp_path / "parquet")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["train/response_length"] > 0
    assert rows[0]["eval/latex/reward"] == rows[0]["eval/latex/pass@2"] == rows[1]["train/reward"] == 1.0
    saved = load_config(tmp_path / "parquet" / "config.yaml")
    assert saved.model.vocab_size == 151936 and saved.data.answer_key == "reward_model.ground_truth"
    runs = list((tmp_path / "parquet" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))  # the run's records, for `wandb sync`


@pytest.mark.e2e
def test_rollouts_through_serve_with_the_checkpoint_tokenizer(qwen3_dir, tmp_path, monkeypatch):
    """rollout.engine=sglang rollout.sglang.server=megatron-pdm: the launched engine starts from the trainer's export,
    which carries the tokenizer files, and serve loads that tokenizer."""
    ckpt = qwen3_dir / "checkpoint"
    config = tmp_path / "q.yaml"
    config.write_text((ROOT / "examples" / "qwen3_vocab_tiny.yaml").read_text()
                      .replace("runs/qwen3_vocab_tiny/checkpoint", str(ckpt))
                      .replace("examples/data/latex_math.jsonl", str(LATEX)))
    _cli(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "rollout.engine=sglang",
          "rollout.sglang.server=megatron-pdm", "rollout.sglang.num_engines=1", "train.steps=1"], tmp_path, monkeypatch)
    assert [r["step"] for r in _rows(tmp_path / "run")] == [0, 1]
    export = tmp_path / "run" / "weights" / "v000001"  # the last export (the first, v000000, was replaced)
    assert (export / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    assert load_tokenizer(export).encode("Hello") == [9707]
