"""Multi-turn rollouts (rollout/multi_turn.py): tool turns are context, never loss; their placeholder behavior rows are
inert in every objective; the chat template renders tool turns; demonstrations for the warm start; the calculator
example end to end. The engines' side (a turn after a reply reads it, on every engine) is in test_engine_contract."""

import math
from pathlib import Path

import pytest
import torch

from megatron_pdm.models import save_hf_checkpoint
from megatron_pdm.models.tokenizer import load_tokenizer
from megatron_pdm.objectives import ObjectiveConfig, loss_normalizer, policy_loss
from megatron_pdm.rollout import RolloutSample
from megatron_pdm.train.batch import rollout_batch
from megatron_pdm.train.config import RolloutConfig, load_config
from megatron_pdm.train.data import ARITHMETIC_TOKENIZER, demonstration, load_rl_data
from tests.helpers import CONFIGS, SEQUENCE_CONFIGS, rank_train
from tests.reference import make_case

ROOT = Path(__file__).resolve().parents[2]
V, K = 40, 5


def _segment(case, rows, prompt_ids):
    b = case.topk
    return RolloutSample(0, prompt_ids, b.token_ids[rows].clone(), b.token_logprobs[rows].clone(),
                         b.topk_ids[rows].clone(), b.topk_logprobs[rows].clone(), "stop", 3, seed=11)


def _two_turn_case():
    """One response: 10 policy tokens, a 4-token tool reply, 12 policy tokens, a 3-token reply, 8 policy tokens
    (`with_turn`, `continued`); the case's 30 rows are the policy's, random logits stand at the replies' rows."""
    case = make_case(30, V, K, dtype=torch.float64, noise=1.0, seed=21)
    s = _segment(case, slice(0, 10), [1, 2])
    for rows, reply in ((slice(10, 22), [5, 6, 7, 8]), (slice(22, 30), [9, 0, 2])):
        s = s.with_turn(reply)
        s = s.continued(_segment(case, rows, s.prompt_ids + s.response_ids.tolist()))
    policy = s.flags()
    logits = torch.randn(len(policy), V, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    logits[policy] = case.logits
    return case, s, logits, policy


def test_a_response_of_turns_keeps_its_bookkeeping():
    case, s, _, policy = _two_turn_case()
    s.check()
    assert policy.tolist() == [True] * 10 + [False] * 4 + [True] * 12 + [False] * 3 + [True] * 8
    assert s.response_ids[10:14].tolist() == [5, 6, 7, 8] and torch.equal(s.last_turn(), case.topk.token_ids[22:])
    assert s.finish_reason == "stop" and s.versions().tolist() == [3] * 37
    # a reply's rows: log mu(k) = 0, a point mass on k; distinct in-range ids (a valid top-K view)
    off = ~policy
    assert (s.token_logprobs[off] == 0).all() and torch.equal(s.topk_ids[off, 0], s.response_ids[off])
    assert (s.topk_logprobs[off, 1:] == -math.inf).all()
    rollout_batch([s], torch.ones(1), pad_id=0, multiple=1, vocab_size=V).behavior.validate(V)


@pytest.mark.parametrize("config", CONFIGS + [ObjectiveConfig(**kw) for kw in SEQUENCE_CONFIGS[:3]],
                         ids=lambda c: f"{c.mask}-{c.loss}-{c.aggregation}-kl{c.kl_coef}-H{c.entropy_coef}-"
                                       f"{c.correction}_{c.correction_level}-{c.rejection}")
def test_tool_tokens_leave_every_objective(config):
    """The loss, its gradient and every metric of a response with tool turns equal those of its policy tokens
    alone, and the tool rows' logits get no gradient: the placeholder behavior rows are inert (no NaN or inf that a
    zero loss mask would multiply into NaN), in every mask, aggregation, KL / entropy term and sequence correction."""
    case, s, logits, policy = _two_turn_case()
    batch = rollout_batch([s], torch.tensor([0.7]), pad_id=0, multiple=1, vocab_size=V)
    g = torch.Generator().manual_seed(8)
    ref_z = logits + torch.randn(logits.shape, dtype=torch.float64, generator=g)
    ref_lp = torch.log_softmax(ref_z, -1).gather(1, batch.targets[:, None]).squeeze(-1)
    old = batch.behavior.token_logprobs + 0.3 * torch.randn(len(policy), dtype=torch.float64, generator=g)
    adv = torch.full((len(policy),), 0.7, dtype=torch.float64) * torch.linspace(-1, 1, len(policy), dtype=torch.float64)

    def run(rows, behavior, mask):
        z = logits[rows].detach().clone().requires_grad_(True)
        seq = torch.zeros(int(rows.sum()), dtype=torch.long)
        out = policy_loss(z, behavior, adv[rows], mask, config, temperature=1.0, sequence_ids=seq,
                          normalizer=float(loss_normalizer(mask, seq, config.aggregation)), old_logprobs=old[rows],
                          ref_logprobs=ref_lp[rows] if config.kl_coef else None, ref_logits=ref_z[rows])
        out.loss.backward()
        return out.loss.detach(), z.grad, out.metrics.reduce(None)

    everything = torch.ones(len(policy), dtype=torch.bool)
    loss, grad, metrics = run(everything, batch.behavior, batch.loss_mask.double())
    alone, alone_grad, alone_metrics = run(policy, case.topk, torch.ones(30, dtype=torch.float64))
    torch.testing.assert_close(loss, alone, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(grad[policy], alone_grad, atol=1e-12, rtol=1e-10)
    assert (grad[~policy] == 0).all()
    assert metrics.keys() == alone_metrics.keys()
    for k, v in metrics.items():
        assert math.isclose(v, alone_metrics[k], rel_tol=1e-9, abs_tol=1e-12), k


def test_tool_turns_rendered_as_the_chat_template_does():
    tok = load_tokenizer(ARITHMETIC_TOKENIZER, embedding_rows=320)
    reply = tok.turn_ids([{"role": "tool", "content": "2146"}])
    assert tok.hf.decode(reply) == "\n<|im_start|>tool\n2146<|im_end|>\n<|im_start|>assistant\n"
    # a demonstration holds exactly what the template renders for the whole conversation after the prompt
    turns = [{"role": "assistant", "content": "37*58"}, {"role": "tool", "content": "2146"},
             {"role": "assistant", "content": "2146"}]
    ids, trained = demonstration(tok, turns, "x:1")
    prompt = tok.render_chat([{"role": "user", "content": "37*58="}])
    whole = tok.hf.apply_chat_template([{"role": "user", "content": "37*58="}, *turns], tokenize=False)
    assert tok.hf.decode(tok.encode(prompt, special=False) + ids) == whole.rstrip("\n")
    assert [t for t, f in zip(ids, trained, strict=True) if not f] == reply
    assert demonstration(tok, "12", "x:2") == (tok.encode("12", special=False) + [tok.eos_id], [True] * 3)
    with pytest.raises(ValueError, match=r"x:3: field 'demo' \(data.warm_start_key\): .* start and end with the "
                                         r"assistant's, got roles \['tool', 'assistant'\]"):
        demonstration(tok, turns[1:], "x:3", key="demo")
    plain = tok.hf.chat_template
    try:  # a template that does not close the assistant's turn with the EOS token
        tok.hf.chat_template = plain.replace("'<|im_end|>\\n'", "'\\n'")
        with pytest.raises(ValueError, match="does not end an assistant turn with the EOS token"):
            tok.turn_ids([{"role": "tool", "content": "1"}])
    finally:
        tok.hf.chat_template = plain


def _calculator(*overrides):
    e = ROOT / "examples"
    return load_config(e / "calculator.yaml", [
        f"rollout.tool_fn={e}/calculator.py:reply", f"data.reward={e}/calculator.py:reward",
        f"data.train_path={e}/data/calculator_train.jsonl", f"data.eval_paths=[{e}/data/calculator_eval.jsonl]",
        f"model.tokenizer={ARITHMETIC_TOKENIZER}", "train.steps=2", "train.prompts_per_step=8", "train.eval_every=2",
        "train.eval_prompts=32", "train.checkpoint_every=100", *overrides])


def test_multi_turn_settings_refused_at_load():
    with pytest.raises(ValueError, match=r"rollout.max_turns: 3 turns need rollout.tool_fn"):
        RolloutConfig(max_turns=3)
    with pytest.raises(ValueError, match=r"rollout.generate_fn: expected 'package.module:function'"):
        RolloutConfig(generate_fn="calculator")
    with pytest.raises(ValueError, match=r"rollout.tool_fn: cannot import 'no_such_module_x'"):
        RolloutConfig(tool_fn="no_such_module_x:reply")
    gen, tool = f"{ROOT}/examples/calculator.py:generate", f"{ROOT}/examples/calculator.py:reply"
    with pytest.raises(ValueError, match=r"rollout.generate_fn: .* use 'sync' or 'lagged', or rollout.tool_fn"):
        RolloutConfig(generate_fn=gen, schedule="streaming")
    with pytest.raises(ValueError, match=r"rollout.tool_fn: .* with rollout.generate_fn .*; give one"):
        RolloutConfig(generate_fn=gen, tool_fn=tool)
    with pytest.raises(ValueError, match=r"calculator_train.jsonl:1: field 'demonstration' demonstrates a response "
                                         r"of 25 tokens, more than rollout.max_new_tokens = 24"):
        load_rl_data(_calculator("rollout.max_new_tokens=24"))


def test_calculator_example_trains_with_tool_turns(dist_pools, tmp_path):
    """examples/calculator.yaml, shortened: the warm start learns the protocol from demonstrations (an expression,
    the tool's reply, the value), so rollouts call the tool; RL steps run at TP 2 and the evaluation scores the
    final turns. Through rollout.tool_fn under the streaming schedule (a reply waits for the next round), and from
    the same weights through the example's generate_fn under the one-step-off schedule (a producer thread)."""
    streamed = _calculator("rollout.schedule=streaming", "train.warm_start_steps=100")
    tool, state = dist_pools(2).run(rank_train, shared=(streamed, str(tmp_path / "tool")))[0]
    init = tmp_path / "init"
    cfg = _calculator(f"rollout.generate_fn={ROOT}/examples/calculator.py:generate", "rollout.tool_fn=null",
                      "rollout.schedule=lagged", "train.warm_start_steps=0", "train.init=hf",
                      f"train.init_path={init}")
    save_hf_checkpoint(init, state, cfg.model)
    generated = dist_pools(2).run(rank_train, shared=(cfg, str(tmp_path / "generated")))[0][0]
    for rows in (tool, generated):
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert all(r["rollout/turns"] > 1.5 for r in rows[1:])  # most responses call the tool
        assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
        # the final turns are scored (0.33 at the start here); two-digit products without the tool score 0
        assert rows[0]["eval/reward"] > 0.1 and rows[-1]["eval/reward"] > 0.1
