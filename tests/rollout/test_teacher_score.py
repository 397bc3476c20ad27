"""An engine teacher's `score()`: `serve` answers a prefill-only /generate (max_new_tokens 0, logprob_start_len) in
SGLang 0.5.23's input-logprob shape, and the SGLangEngine client reads it back, both against an independent float64
forward of the same HF weights."""

import pytest
import torch

from megatron_pdm.rollout.sglang.client import SGLangEngine
from megatron_pdm.rollout.sglang.pool import post
from megatron_pdm.rollout.sglang.wire import AbortedRequest, parse_score_output, score_request
from tests.helpers import DENSE, _in_process_server, hf_model, sglang_section

pytestmark = pytest.mark.e2e

SEED = 21  # _in_process_server's checkpoint seed: the reference rebuilds the same weights
# log-probs of a float32 forward of this 2-layer, 32-wide model against a float64 one: float32 rounding of logits
# of size ~1 gives ~1e-6; 1e-4 leaves two orders of margin and is far below the gaps top-K order depends on
TOL = 1e-4


def reference(seq, start, k):
    """float64 t(. | x_<p) for p in [start, L): (token log-probs, top-K log-probs, top-K ids)."""
    model = hf_model(DENSE, seed=SEED).double()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, start - 1: len(seq) - 1], -1)
    top_lps, top_ids = logp.topk(k, dim=-1)
    return logp.gather(1, torch.tensor(seq[start:])[:, None]).squeeze(-1), top_lps, top_ids


def check(scores, seq, start, k):
    tok, top_lps, top_ids = reference(seq, start, k)
    assert scores.token_logprobs.dtype == torch.float32 and scores.topk_ids.dtype == torch.long
    assert scores.topk_ids.shape == (len(seq) - start, k)
    assert torch.allclose(scores.token_logprobs.double(), tok, atol=TOL, rtol=0)
    assert torch.allclose(scores.topk_logprobs.double(), top_lps, atol=TOL, rtol=0)
    # ids must agree where the reference's order is decided by more than the tolerance (gaps to both neighbours)
    gap = top_lps[:, :-1] - top_lps[:, 1:]
    clear = torch.ones_like(top_ids, dtype=torch.bool)
    clear[:, :-1] &= gap > 2 * TOL
    clear[:, 1:] &= gap > 2 * TOL
    assert clear.any() and torch.equal(scores.topk_ids[clear], top_ids[clear])


SEQS = [[5, 9, 17, 2, 33, 8, 41, 40], [7, 3, 3, 100, 250, 11], [1, 2, 3]]
STARTS = [3, 1, 3]  # the last scores nothing (start == L): an empty answer, not an error


def test_serve_and_the_client_score_as_a_float64_forward(tmp_path):
    K = 5
    server, url, stop = _in_process_server(tmp_path, DENSE, seed=SEED, test_hooks=True)
    try:
        # serve's raw answer: SGLang's shape, one entry per input token from logprob_start_len, the first null
        out = post(url, "/generate", score_request(SEQS[0], STARTS[0], K), 30)
        meta = out["meta_info"]
        assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["input_token_logprobs"][0] == [None, SEQS[0][STARTS[0] - 1], None]
        assert meta["input_top_logprobs"][0] is None
        assert [e[1] for e in meta["input_token_logprobs"]] == SEQS[0][STARTS[0] - 1:]
        check(parse_score_output(out, index=0, sequence=SEQS[0], start=STARTS[0], k=K, vocab_size=DENSE.vocab_size),
              SEQS[0], STARTS[0], K)
        # a bad request is refused naming the field (HTTP 400)
        with pytest.raises(Exception, match="logprob_start_len"):
            post(url, "/generate", {**score_request(SEQS[0], 1, K), "logprob_start_len": -1}, 30)

        engine = SGLangEngine(sglang_section(urls=[url], timeout_s=30, retries=1), DENSE,
                              weight_dir=tmp_path / "weights", backoff=0.1)
        engine.wait_ready(60)
        got = engine.score(SEQS, STARTS, K)
        assert len(got) == 3 and got[2].topk_ids.shape == (0, K) and got[2].token_logprobs.shape == (0,)
        for scores, seq, start in zip(got[:2], SEQS[:2], STARTS[:2], strict=True):
            check(scores, seq, start, K)
        # an aborted answer (serve's abort hook, as /pause_generation aborts) is sent again, never scored
        post(url, "/megatron_pdm/faults", {"abort_generates": 1}, 30)
        again = engine.score(SEQS[:1], STARTS[:1], K)[0]
        assert server.abort_generates == 0 and torch.equal(again.topk_ids, got[0].topk_ids)
        # the embedded engine (serve's) gives the same numbers in-process
        mine = server.engine.score(SEQS[:2], STARTS[:2], K)
        for a, b in zip(mine, got[:2], strict=True):
            assert torch.equal(a.topk_ids, b.topk_ids) and torch.allclose(a.topk_logprobs, b.topk_logprobs)
        with pytest.raises(ValueError, match=r"starts\[0\] 0 is not in \[1, 8\]"):
            engine.score(SEQS[:1], [0], K)
    finally:
        stop()


def test_malformed_score_answers_name_the_field():
    seq, start, k = [4, 5, 6, 7], 2, 2
    good = {"output_ids": [], "meta_info": {
        "finish_reason": {"type": "length", "length": 0},
        "input_token_logprobs": [[None, 5, None], [-1.0, 6, None], [-2.0, 7, None]],
        "input_top_logprobs": [None, [[-0.5, 1, None], [-1.0, 6, None]], [[-0.1, 3, None], [-2.0, 7, None]]]}}
    s = parse_score_output(good, index=0, sequence=seq, start=start, k=k, vocab_size=10)
    assert s.token_logprobs.tolist() == [-1.0, -2.0] and s.topk_ids.tolist() == [[1, 6], [3, 7]]

    def bad(**meta):
        return {"output_ids": [], "meta_info": {**good["meta_info"], **meta}}

    cases = [
        (bad(input_token_logprobs=None), "input_token_logprobs: expected 3 entries"),
        (bad(input_top_logprobs=good["meta_info"]["input_top_logprobs"][:2]), "input_top_logprobs: expected 3"),
        (bad(input_token_logprobs=[[None, 5, None], [-1.0, 9, None], [-2.0, 7, None]]),
         r"input_token_logprobs\[1\]: token 9, but the sequence has 6"),
        (bad(input_top_logprobs=[None, [[-0.5, 1, None]], [[-0.1, 3, None], [-2.0, 7, None]]]),
         r"input_top_logprobs\[1\]: expected 2 entries"),
        (bad(input_top_logprobs=[None, [[-0.5, 1, None], [-1.0, 60, None]], [[-0.1, 3, None], [-2.0, 7, None]]]),
         "token id 60 outside"),
        (bad(input_token_logprobs=[[None, 5, None], [float("nan"), 6, None], [-2.0, 7, None]]), "log-prob nan"),
        (bad(input_top_logprobs=[None, [["x", 1, None], [-1.0, 6, None]], [[-0.1, 3, None], [-2.0, 7, None]]]),
         r"input_top_logprobs\[1\]\[0\]: expected \[logprob, id, text\]"),
        ({"output_ids": []}, "meta_info: missing"),
    ]
    for out, match in cases:
        with pytest.raises(ValueError, match=match):
            parse_score_output(out, index=0, sequence=seq, start=start, k=k, vocab_size=10)
    with pytest.raises(AbortedRequest):
        parse_score_output(bad(finish_reason={"type": "abort", "message": "Abort"}), index=0, sequence=seq,
                           start=start, k=k, vocab_size=10)
