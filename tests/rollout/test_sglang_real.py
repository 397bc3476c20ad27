"""The real SGLang 0.5.23 on this CPU: the client, the trainer and `megatron-pdm serve` against it.

The tier `make test-sglang` (tests marked sglang_real; skipped unless $MEGATRON_PDM_SGLANG_PYTHON names the python of
the CPU engine environment that `make engine-env-cpu` builds): `python -m sglang.launch_server --device cpu
--attention-backend torch_native` on a tiny Qwen3 written by our own export (the main job's model, bf16), started by
our own launcher (`rollout.sglang.launcher.EngineProcess`, `LaunchSpec.python`). One server serves the module (a start
costs 1.5 to 2.5 minutes of imports on 2 cores); the trainer's launched-engine test starts two more behind
sglang-router. Every server's log is checked at its end: no NotImplementedError from the stand-in `sgl_kernel`
(engine/sgl_kernel), so the math is SGLang's own torch-native path.

Covered: the wire (generate and extend with top-K log-probs against an fp32 recomputation, weight versions and
spans, seeds, stop ids and the checkpoint's EOS ids, abort), recorded as tests/data/sglang/generate_recorded_cpu.json;
weight updates by disk, tensor and distributed (gloo), inside and outside weight-update sessions, a failing, a slow
(the version poll) and a refused one; `megatron-pdm train` attached per sync mode and schedule (lagged, streaming),
the calculator example's multi-turn path, and engines the trainer launches through `rollout.sglang.engine_python` behind
sglang-router 0.3.2. The conformance table (`CONFORMANCE`, rendered into tests/data/sglang/conformance.md) is checked
against both servers: serve's column in the default suite, SGLang's here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import yaml

from megatron_pdm.models import ModelConfig, canonical_hf_state
from megatron_pdm.rollout import SamplingParams
from megatron_pdm.rollout.sglang.client import SGLangEngine
from megatron_pdm.rollout.sglang.launcher import EngineProcess, LaunchSpec
from megatron_pdm.rollout.sglang.transports import write_export
from megatron_pdm.rollout.sglang.wire import SERVE_VERSION, AbortedRequest, parse_generate_output, score_request
from megatron_pdm.train.data import ARITHMETIC_TOKENIZER
from tests.helpers import _in_process_server, hf_model, sglang_section

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
SGLANG_DATA = ROOT / "tests" / "data" / "sglang"
PYTHON = os.environ.get("MEGATRON_PDM_SGLANG_PYTHON")
REAL = pytest.mark.sglang_real
# the main job's model (examples/tiny_cpu.yaml) with 512 positions: room for the abort test's long request
MODEL = dict(model_type="qwen3", vocab_size=320, hidden_size=64, num_layers=2, num_attention_heads=4,
             num_query_groups=2, head_dim=16, ffn_hidden_size=128, max_position_embeddings=512)
CFG = ModelConfig(**MODEL)
# SGLang 0.5.23's CPU mode (SGLANG_USE_CPU_ENGINE=1 selects the platform): torch-native attention, a KV cache of
# 4096 tokens; --mem-fraction-static is the share of the free host memory at start that SGLang may take (0.5: the
# check that the loaded weights leave room fails below ~0.08 when other processes take memory during the start)
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "4096",
            "--mem-fraction-static", "0.5", "--disable-cuda-graph")
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
EOS = (2, 0)  # the arithmetic tokenizer's EOS and generation_config.json's eos_token_id [2, 0]
STOP = 3  # a stop id of our own, not an EOS id
# bf16 engines against the fp32 recomputation of their bf16-rounded weights: the measured worst was 0.0035 (SGLang
# computes in bf16); another version's weights differ by 0.6 to 0.9, so the bound tells the versions apart
LOGPROB_ATOL = 0.03


def _state(seed: int) -> dict:
    return canonical_hf_state(hf_model(CFG, seed=seed).state_dict())


def _export(path: Path, seed: int) -> Path:
    """An engine checkpoint as the trainer writes it: bf16, with the arithmetic tokenizer and its generation config."""
    return write_export(_state(seed), path, CFG, fp8=False, dtype="bfloat16", tokenizer_dir=ARITHMETIC_TOKENIZER)


def _spec(log_dir: Path, **kw) -> LaunchSpec:
    return LaunchSpec(server="sglang", python=PYTHON, server_args=CPU_ARGS, log_dir=log_dir, dtype="bfloat16",
                      startup_timeout_s=900.0, **kw)


def check_engine_log(path: Path) -> None:
    """A real server's log: no call reached the stand-in sgl_kernel (every name raises NotImplementedError)."""
    text = path.read_text(errors="replace")
    assert "NotImplementedError" not in text, f"{path}: the stand-in sgl_kernel was called:\n{text[-3000:]}"


@dataclass
class Server:
    url: str
    init: Path  # the launch checkpoint (seed 21, version 0)
    log: Path


@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    """One real SGLang server for the module, started by our launcher from an export of seed 21 at version 0."""
    d = tmp_path_factory.mktemp("sglang")
    init = _export(d / "init", seed=21)
    proc = EngineProcess(_spec(d), 0)
    with pytest.MonkeyPatch.context() as mp:  # the server inherits them; this process keeps its own
        for k, v in CPU_ENV.items():
            mp.setenv(k, v)
        proc.start(str(init), 0)
    try:
        proc.wait_ready()
        yield Server(proc.url, init, d / "engine-0.log")
    finally:
        proc.stop()
    check_engine_log(d / "engine-0.log")


@pytest.fixture
def serve(tmp_path):
    """`megatron-pdm serve`'s server on a thread of this process, launched from the same kind of export."""
    server, url, stop = _in_process_server(tmp_path, CFG, path=_export(tmp_path / "init", seed=21), dtype="bfloat16")
    yield Server(url, tmp_path / "init", Path(os.devnull))
    stop()


@pytest.fixture(params=["serve", pytest.param("sglang", marks=REAL)])
def server(request):
    """Each contract test against `serve` (default suite) and the real SGLang 0.5.23 (the tier)."""
    return request.param, request.getfixturevalue(request.param)


# -- raw HTTP ---------------------------------------------------------------------------------------------------------
@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes

    def json(self):
        return json.loads(self.body)


def call(url: str, path: str, body=None, timeout: float = 60.0) -> Answer:
    """One request (GET without a body, else POST of JSON), its status, content type and raw body, errors too."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Answer(r.status, r.headers.get("Content-Type") or "", r.read())
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.headers.get("Content-Type") or "", e.read())


def _kind(answer: Answer) -> str:
    """How an answer is described in the conformance table: its status and the shape of its body."""
    if not answer.body:
        return f"{answer.status}, empty body"
    try:
        body = answer.json()
    except ValueError:
        return f"{answer.status}, text: {answer.body.decode(errors='replace').splitlines()[0]}"
    if isinstance(body, dict) and "success" in body:
        message = str(body.get("message", ""))
        for phrase in ("no weight-update session is open", "already open", "must run between begin_weight_update",
                       "Repo id must be", "No such file"):
            if phrase in message:
                return f"{answer.status}, success {str(body['success']).lower()}: ...{phrase}..."
        return f"{answer.status}, success {str(body['success']).lower()}"
    if isinstance(body, dict) and "status" in body:
        return f"{answer.status}, status {body['status']}: {body.get('message')}"
    return f"{answer.status}, JSON {type(body).__name__}"


# -- the conformance table ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One behaviour of the worker API: what serve answers, what SGLang 0.5.23 answers, and (where they differ)
    why serve differs on purpose."""

    case: str
    serve: str
    sglang: str
    why: str = ""


# the answer to `wire.score_request` (the teacher's scoring request) as `_prefill_only` describes it
PREFILL_ONLY = ("200: no output_ids, finish length; input_token_logprobs ids [7, 8, 9] with log-probs null, number, "
                "number; input_top_logprobs null, then 3 entries, 3 entries")
CONFORMANCE = [
    Row("GET /health", "200, empty body", "200, empty body"),
    Row("GET /get_weight_version", "404", "404"),
    Row("GET /model_info after a disk update", "the update's model_path and weight_version",
        "the update's model_path and weight_version"),
    Row("GET /get_model_info", "as /model_info", "as /model_info"),
    Row("GET /server_info after a disk update", "the launch's model_path and weight_version",
        "the launch's model_path and weight_version"),
    Row("GET /server_info version", SERVE_VERSION, "0.5.23",
        "the client tells serve (gloo-only distributed updates) from SGLang by it"),
    Row("GET /server_info device", "cpu", "cpu"),
    Row("POST /flush_cache", "200, text: Cache flushed.", "200, text: Cache flushed."),
    Row("POST /pause_generation", "200, status ok: Generation paused successfully.",
        "200, status ok: Generation paused successfully."),
    Row("POST /continue_generation", "200, status ok: Generation continued successfully.",
        "200, status ok: Generation continued successfully."),
    Row("POST /end_weight_update, none open", "400, success false: ...no weight-update session is open...",
        "400, success false: ...no weight-update session is open..."),
    Row("POST /begin_weight_update", "200, success true", "200, success true"),
    Row("POST /begin_weight_update, one open", "400, success false: ...already open...",
        "400, success false: ...already open..."),
    Row("POST /update_weights_from_disk, a session open", "200, success true", "200, success true"),
    Row("POST /update_weights_from_tensor, none open",
        "400, success false: ...must run between begin_weight_update...",
        "400, success false: ...must run between begin_weight_update..."),
    Row("POST /update_weights_from_distributed, none open",
        "400, success false: ...must run between begin_weight_update...",
        "400, success false: ...must run between begin_weight_update..."),
    Row("POST /update_weights_from_disk, a missing directory", "400, success false: ...No such file...",
        "400, success false: ...Repo id must be...",
        "serve names the missing file; SGLang takes the path for a hub id (offline); both refuse with success false"),
    Row("a failed disk update leaves the version", "unchanged", "unchanged"),
    Row("POST /generate, one row", "200, JSON dict", "200, JSON dict"),
    Row("POST /generate, rows with one sampling_params each", "200, JSON list", "200, JSON list"),
    Row("POST /generate, sampling_params a list (sglang-router 0.3.2 refuses it: one dict a request)",
        "200, JSON list", "200, JSON list"),
    Row("POST /generate stops at", "stop_token_ids and the checkpoint's EOS ids",
        "stop_token_ids and the checkpoint's EOS ids"),
    Row("POST /generate with ignore_eos stops at", "no token (max_new_tokens)", "no token (max_new_tokens)"),
    Row("POST /generate sampling_seed", "honoured", "ignored",
        "serve keys sampling on (seed, position), as SGLang does with --enable-deterministic-inference only, which "
        "the tier's servers are not started with"),
    Row("POST /generate, max_new_tokens 0, logprob_start_len 2, on 5 tokens (a teacher's score)", PREFILL_ONLY,
        PREFILL_ONLY),
    Row("POST /release_memory_occupation", "200", "kills the server (not sent)",
        "serve stands in for GPU engines that free memory; a CPU SGLang dies (rollout.sglang.release_memory is refused "
        "for CPU engines at load)"),
]
NOT_PROBED = {("POST /release_memory_occupation", "sglang")}  # the row is what the reference measurement saw


def render_table() -> str:
    """The conformance table as markdown (tests/data/sglang/conformance.md holds it)."""
    lines = ["| case | megatron-pdm serve | SGLang 0.5.23 (CPU) | why serve differs |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.case} | {r.serve} | {r.sglang} | {r.why} |" for r in CONFORMANCE]
    return "\n".join(lines) + "\n"


def test_conformance_table_is_recorded():
    """tests/data/sglang/conformance.md is the table the tests check (regenerate: print(render_table()))."""
    text = (SGLANG_DATA / "conformance.md").read_text()
    assert render_table() in text, "tests/data/sglang/conformance.md is stale: paste render_table() into it"


def _generate_body(rows: int, *, stop=(STOP,), max_new_tokens: int = 24, seed0: int = 100, ignore_eos=None,
                   one_dict: bool = False) -> dict:
    sampling = [{"temperature": 1.0, "max_new_tokens": max_new_tokens, "top_p": 1.0, "top_k": -1,
                 "stop_token_ids": list(stop), "sampling_seed": seed0 + i,
                 **({} if ignore_eos is None else {"ignore_eos": ignore_eos})} for i in range(rows)]
    return {"input_ids": [[5, 6, 7]] * rows if rows > 1 or not one_dict else [5, 6, 7],
            "sampling_params": sampling[0] if one_dict else sampling, "return_logprob": True,
            "top_logprobs_num": 2, "logprob_start_len": -1}


def _stops_at(url: str, *, ignore_eos) -> str:
    """What a batch of 128 rows of 24 tokens with stop_token_ids [3] stops at, told apart by what runs past: with
    EOS stops no EOS id (0 or 2) and no 3 ends up inside a response; with stop_token_ids alone an EOS id does; with
    neither, nothing finishes on "stop" and one of them is inside. A random tiny model samples near-uniformly over
    320 ids, so the about 3,000 tokens hold one of these ids with probability 1 - (317/320)^3000 > 1 - 1e-12, and an
    EOS id where only 3 stops with 1 - (318/320)^2500 > 1 - 1e-6. (The check asked for every one of the three ids
    once, which a run misses with about 2% chance: one SGLang run had no 2 in 1,536 tokens.)"""
    out = call(url, "/generate", _generate_body(128, ignore_eos=ignore_eos), timeout=300).json()
    ids = [o["output_ids"] for o in out]
    inner = {t for r in ids for t in r[:-1]}
    ends = {r[-1] for r, o in zip(ids, out, strict=True) if o["meta_info"]["finish_reason"]["type"] == "stop"}
    stops = {STOP, *EOS}
    if not ends and inner & stops:
        return "no token (max_new_tokens)"
    if ends and ends <= stops and not inner & stops and ends & set(EOS):
        return "stop_token_ids and the checkpoint's EOS ids"
    if ends == {STOP} and STOP not in inner and inner & set(EOS):
        return "stop_token_ids"
    raise AssertionError(f"stops at {ends}, runs past {inner & stops}: {ids}")


def observe(name: str, s: Server, tmp_path: Path) -> dict[str, str]:
    """Every CONFORMANCE case as the server at `s` answers it (the column `name` of the table). Starts from any
    state the server was left in: it opens and closes its own weight-update session."""
    seen = {}
    launch = call(s.url, "/server_info").json()
    seen["GET /health"] = _kind(call(s.url, "/health"))
    seen["GET /get_weight_version"] = str(call(s.url, "/get_weight_version").status)
    seen["GET /server_info version"] = str(launch.get("version"))
    seen["GET /server_info device"] = str(launch.get("device"))
    seen["POST /flush_cache"] = _kind(call(s.url, "/flush_cache", {}))
    call(s.url, "/end_weight_update", {})  # any session left open by an earlier test: closed (or refused)
    seen["POST /end_weight_update, none open"] = _kind(call(s.url, "/end_weight_update", {}))
    seen["POST /update_weights_from_tensor, none open"] = _kind(
        call(s.url, "/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="], "load_format": None}))
    seen["POST /update_weights_from_distributed, none open"] = _kind(
        call(s.url, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [], "group_name": "g"}))
    version_before = call(s.url, "/model_info").json()["weight_version"]
    seen["POST /update_weights_from_disk, a missing directory"] = _kind(
        call(s.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing"), "weight_version": "77"}))
    after = call(s.url, "/model_info").json()["weight_version"]
    seen["a failed disk update leaves the version"] = "unchanged" if after == version_before else f"now {after}"
    export = _export(tmp_path / f"conformance-{name}", seed=23)
    seen["POST /begin_weight_update"] = _kind(call(s.url, "/begin_weight_update", {}))
    seen["POST /begin_weight_update, one open"] = _kind(call(s.url, "/begin_weight_update", {}))
    seen["POST /update_weights_from_disk, a session open"] = _kind(call(s.url, "/update_weights_from_disk", {
        "model_path": str(export), "weight_version": "41", "flush_cache": True}))
    call(s.url, "/end_weight_update", {})
    info, server_info = call(s.url, "/model_info").json(), call(s.url, "/server_info").json()
    now = (info["model_path"], info["weight_version"])
    seen["GET /model_info after a disk update"] = (
        "the update's model_path and weight_version" if now == (str(export), "41") else ", ".join(now))
    seen["GET /get_model_info"] = "as /model_info" if call(s.url, "/get_model_info").json() == info else "differs"
    said = (server_info["model_path"], server_info["weight_version"])
    seen["GET /server_info after a disk update"] = (
        "the launch's model_path and weight_version" if said == (launch["model_path"], launch["weight_version"])
        else ", ".join(said))
    seen["POST /pause_generation"] = _kind(call(s.url, "/pause_generation", {}))
    seen["POST /continue_generation"] = _kind(call(s.url, "/continue_generation", {}))
    seen["POST /generate, one row"] = _kind(call(s.url, "/generate", _generate_body(1, one_dict=True)))
    seen["POST /generate, rows with one sampling_params each"] = _kind(call(s.url, "/generate", _generate_body(2)))
    seen["POST /generate, sampling_params a list (sglang-router 0.3.2 refuses it: one dict a request)"] = \
        seen["POST /generate, rows with one sampling_params each"]
    seen["POST /generate stops at"] = _stops_at(s.url, ignore_eos=None)
    seen["POST /generate with ignore_eos stops at"] = _stops_at(s.url, ignore_eos=True)
    twice = [call(s.url, "/generate", _generate_body(4, max_new_tokens=8)).json() for _ in range(2)]
    seen["POST /generate sampling_seed"] = "honoured" if [[o["output_ids"] for o in t] for t in twice][0] == \
        [o["output_ids"] for o in twice[1]] else "ignored"
    seen["POST /generate, max_new_tokens 0, logprob_start_len 2, on 5 tokens (a teacher's score)"] = \
        _prefill_only(s.url)
    if name == "serve":
        seen["POST /release_memory_occupation"] = str(call(s.url, "/release_memory_occupation", {}).status)
        call(s.url, "/resume_memory_occupation", {})
    return seen


def _prefill_only(url: str) -> str:
    """The shape of the answer to the teacher's scoring request (`wire.score_request`: positions 3 and 4 of a
    5-token input, so logprob_start_len 2, top 3)."""
    answer = call(url, "/generate", score_request([5, 6, 7, 8, 9], 3, 3))
    if answer.status != 200:
        return _kind(answer)
    out = answer.json()
    meta = out["meta_info"]
    tok, top = meta["input_token_logprobs"], meta["input_top_logprobs"]
    kinds = ", ".join("null" if e[0] is None else "number" for e in tok)
    rows = ", ".join("null" if r is None else f"{len(r)} entries" for r in top)
    return (f"{answer.status}: {'no output_ids' if not out['output_ids'] else out['output_ids']}, finish "
            f"{meta['finish_reason']['type']}; input_token_logprobs ids {[e[1] for e in tok]} with log-probs {kinds}; "
            f"input_top_logprobs {rows.replace('null, ', 'null, then ', 1)}")


def test_conformance(server, tmp_path):
    """`serve` is a faithful stand-in: every CONFORMANCE case answers as its column says (a difference has its
    reason in the table)."""
    name, s = server
    seen = observe(name, s, tmp_path)
    expected = {r.case: getattr(r, name) for r in CONFORMANCE if (r.case, name) not in NOT_PROBED}
    wrong = {case: (seen.get(case), want) for case, want in expected.items() if seen.get(case) != want}
    assert not wrong, "\n".join(f"{case}: saw {got!r}, the table says {want!r}" for case, (got, want) in wrong.items())


# -- the wire ----------------------------------------------------------------------------------------------------------
def _reference(seed: int) -> torch.nn.Module:
    """The fp32 HF model of seed `seed` with its weights rounded to bf16, as the engines hold them."""
    model = hf_model(CFG, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def _logprob_error(model, samples, temperature: float) -> float:
    """The largest |log mu - log_softmax(logits / T)| over every sample's tokens and top-K ids (the engine's ids)."""
    worst = 0.0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids.tolist()])
            logits = model(ids).logits[0, len(s.prompt_ids) - 1 : -1].float()
            lp = torch.log_softmax(logits / temperature, dim=-1)
            worst = max(worst, (lp.gather(1, s.response_ids[:, None])[:, 0] - s.token_logprobs).abs().max().item(),
                        (lp.gather(1, s.topk_ids) - s.topk_logprobs).abs().max().item())
    return worst


def _client(url: str, tmp_path: Path, **rollout) -> SGLangEngine:
    engine = SGLangEngine(sglang_section(urls=(url,), **{"timeout_s": 120, **rollout}), CFG,
                          weight_dir=tmp_path / "weights", dtype="bfloat16", tokenizer_dir=ARITHMETIC_TOKENIZER,
                          backoff=0.1)
    engine.wait_ready(120)
    return engine


def _shape(value):
    """The keys of every object in a JSON value, recursively (lists by their first element): its schema."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


PARAMS = SamplingParams(max_new_tokens=8, n=2, temperature=0.8, top_k_logprobs=4, stop_token_ids=(STOP,), seed=5)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]


def _check_samples(samples, version: int) -> None:
    for s in samples:
        s.check()
        ids = s.response_ids.tolist()
        assert s.weight_version == version and s.topk_ids.shape == (len(ids), 4)
        assert bool((s.topk_logprobs[:, :-1] >= s.topk_logprobs[:, 1:]).all())  # sorted, most likely first
        assert not {STOP, *EOS} & set(ids[:-1])  # stops at the stop id and the checkpoint's EOS ids
        assert s.finish_reason == ("stop" if ids[-1] in (STOP, *EOS) else "length")


@REAL
def test_wire_generate_extend_abort_and_the_recorded_response(sglang, tmp_path):
    """The client's /generate against SGLang 0.5.23: every sample at the pushed version, top-K log-probs of
    log_softmax(logits / T) (the fp32 recomputation of the bf16 weights), stops at the stop id and the EOS ids, an
    extension across a weight update tagged per span, and an aborted request (/pause_generation) never scored. The
    hand-written fixture's request, answered by the real server, has the shape of the committed recording
    (MEGATRON_PDM_RECORD_SGLANG=1 rewrites tests/data/sglang/generate_recorded_cpu.json)."""
    engine = _client(sglang.url, tmp_path)
    try:
        engine.update_weights(_state(22), version=3)
        fx = json.loads((SGLANG_DATA / "generate_handwritten.json").read_text())
        answer = call(sglang.url, "/generate", fx["request"]).json()
        recorded = {"source": "recorded by tests/test_sglang_real.py from sglang 0.5.23 on a CPU (--device cpu "
                              "--attention-backend torch_native, the stand-in sgl_kernel), the tier's tiny Qwen3 "
                              "(random weights, bf16) with the arithmetic tokenizer, weight version 3",
                    "sglang_version": "0.5.23", "vocab_size": CFG.vocab_size, "request": fx["request"],
                    "response": answer}
        if os.environ.get("MEGATRON_PDM_RECORD_SGLANG") == "1":
            (SGLANG_DATA / "generate_recorded_cpu.json").write_text(json.dumps(recorded, indent=1) + "\n")
        committed = json.loads((SGLANG_DATA / "generate_recorded_cpu.json").read_text())
        assert _shape(committed["response"]) == _shape(answer)

        model = _reference(22)
        samples = engine.generate(PROMPTS, PARAMS)
        _check_samples(samples, 3)
        assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
        assert _logprob_error(model, samples, PARAMS.temperature) < LOGPROB_ATOL
        assert _logprob_error(_reference(23), samples, PARAMS.temperature) > 0.2  # the bound tells weights apart

        # cut at 2 tokens, the same weights again as version 4 (by tensor, in a session), continued by extend:
        # each span tagged with the version that generated it
        cut = engine.generate(PROMPTS, replace(PARAMS, max_new_tokens=2))
        engine.weight_sync = "tensor"
        engine.update_weights(_state(22), version=4)
        extended = engine.extend(cut, PARAMS)
        for c, x in zip(cut, extended, strict=True):
            x.check()
            n = len(c.response_ids)
            assert torch.equal(x.response_ids[:n], c.response_ids) and x.seed == c.seed is not None
            assert x.versions().tolist() == [3] * n + [4] * (len(x.response_ids) - n)
        assert _logprob_error(model, extended, PARAMS.temperature) < LOGPROB_ATOL
    finally:
        engine.close()

    # abort: a long request in flight when /pause_generation comes answers finish_reason abort, never scored
    log = sglang.log.read_text(errors="replace").count("Prefill batch")
    body = _generate_body(16, stop=(), max_new_tokens=400, ignore_eos=True)
    result = {}
    t = threading.Thread(target=lambda: result.update(out=call(sglang.url, "/generate", body, timeout=300)))
    t.start()
    deadline = time.monotonic() + 120  # the request reaches the scheduler (its prefill is logged)
    while sglang.log.read_text(errors="replace").count("Prefill batch") == log and time.monotonic() < deadline:
        time.sleep(0.05)
    assert call(sglang.url, "/pause_generation", {}).status == 200
    t.join(timeout=120)
    assert call(sglang.url, "/continue_generation", {}).status == 200
    out = result["out"].json()
    assert {o["meta_info"]["finish_reason"]["type"] for o in out} == {"abort"}
    assert all(len(o["output_ids"]) < 400 for o in out)
    with pytest.raises(AbortedRequest):
        parse_generate_output(out[0], prompt_index=0, prompt_ids=[5, 6, 7], k=2, vocab_size=CFG.vocab_size,
                              weight_version=4)


# -- weight updates ----------------------------------------------------------------------------------------------------
def _stream(state, per_bucket=4):
    keys = list(state)
    for i in range(0, len(keys), per_bucket):
        yield {k: state[k] for k in keys[i : i + per_bucket]}


@REAL
def test_weight_updates_by_every_transport_and_their_failures(sglang, tmp_path, caplog, monkeypatch):
    """Disk (outside a session), tensor and distributed (gloo; inside 0.5.23's weight-update session), a full dict
    and a stream of buckets: the engine samples from the weights pushed last, at their version, and no session is
    left open. A failing disk update drops the (attached) engine, which stays healthy at its version; a disk update
    slower than the update timeout is awaited by polling /model_info (0.5.23 has no /get_weight_version: the poll's
    404 dropped a healthy engine); a distributed update over a group the engine no longer holds (destroyed behind
    the client's back, as by an engine restarted on its URL) fails at once, naming it (over gloo the broadcast sees
    the engine's side closed; with NCCL the engine's refusal ends its grace), and the engine is dropped."""
    from megatron_pdm.rollout.sglang import pool as pool_module
    from megatron_pdm.rollout.sglang import transports
    from megatron_pdm.rollout.sglang.pool import TimedOut, UpdateAborted

    engine = _client(sglang.url, tmp_path, sync_bucket_bytes=64 << 10)
    try:
        for version, (sync, seed, stream) in enumerate(
                [("disk", 31, False), ("tensor", 32, True), ("distributed", 33, False), ("distributed", 34, True),
                 ("tensor", 35, False), ("disk", 36, True)], start=10):
            engine.weight_sync = sync
            state = _state(seed)
            engine.update_weights(_stream(state) if stream else state, version=version)
            samples = engine.generate(PROMPTS, PARAMS)
            _check_samples(samples, version)
            assert _logprob_error(_reference(seed), samples, PARAMS.temperature) < LOGPROB_ATOL, (sync, stream)
            assert engine.pool.alive == [sglang.url]
        assert call(sglang.url, "/begin_weight_update", {}).status == 200  # none left open
        assert call(sglang.url, "/end_weight_update", {}).status == 200
        assert call(sglang.url, "/model_info").json()["weight_version"] == "15"

        # refused: the engine's weights group destroyed behind the client's back; its announcement is refused and
        # its side of the group is gone, so the update fails at once naming it (not after the group's timeout)
        engine.weight_sync = "distributed"
        engine.update_weights(_state(31), version=16)
        group = engine.transports["distributed"].name
        assert call(sglang.url, "/destroy_weights_update_group", {"group_name": group}).status == 200
        monkeypatch.setattr(transports, "REFUSAL_GRACE_S", 1.0)  # the grace, shortened: what counts is that it ends
        start = time.monotonic()
        with caplog.at_level("WARNING"), pytest.raises((UpdateAborted, RuntimeError)):
            engine.update_weights(_state(32), version=17)
        assert time.monotonic() - start < 60  # at once, not after the 120 s update timeout
        assert f"dropping SGLang worker {sglang.url}" in caplog.text
        assert engine.pool.alive == [] and call(sglang.url, "/health").status == 200
        assert call(sglang.url, "/model_info").json()["weight_version"] == "16"
    finally:
        engine.close()

    # failing: a disk update of a directory that is not there: SGLang answers 400, the attached engine is dropped,
    # and keeps serving its version
    failing = _client(sglang.url, tmp_path / "failing")
    try:
        failing.update_weights(_state(31), version=20)
        monkeypatch.setattr(failing.transports["disk"], "export", lambda weights, version: tmp_path / "missing")
        with caplog.at_level("WARNING"), pytest.raises(RuntimeError, match="no SGLang worker left"):
            failing.update_weights(_state(32), version=21)
        assert f"dropping SGLang worker {sglang.url}" in caplog.text and "HTTP 400" in caplog.text
        assert call(sglang.url, "/model_info").json()["weight_version"] == "20"
        assert call(sglang.url, "/health").status == 200
    finally:
        failing.close()

    # slow: the load outlasts the update timeout (the answer is withheld from the client, the request is real), so
    # the client polls /model_info until the engine reports the version, and keeps the engine
    slow = _client(sglang.url, tmp_path / "slow", update_timeout_s=60)
    real_post = pool_module.post

    def late(url, path, body, timeout):
        if path != pool_module.DISK_UPDATE:
            return real_post(url, path, body, timeout)
        threading.Thread(target=real_post, args=(url, path, body, timeout), daemon=True).start()
        raise TimedOut(f"{url}{path}: no answer within {timeout:.0f} s", (url,))

    try:
        slow.update_weights(_state(31), version=22)
        monkeypatch.setattr(pool_module, "post", late)
        caplog.clear()
        with caplog.at_level("WARNING"):
            slow.update_weights(_state(33), version=23)
        assert slow.pool.alive == [sglang.url] and slow.weight_version == 23
        assert "polling /model_info" in caplog.text and "took the update to version 23" in caplog.text
        assert call(sglang.url, "/model_info").json()["weight_version"] == "23"
        monkeypatch.setattr(pool_module, "post", real_post)
        samples = slow.generate(PROMPTS, PARAMS)
        _check_samples(samples, 23)
        assert _logprob_error(_reference(33), samples, PARAMS.temperature) < LOGPROB_ATOL
    finally:
        slow.close()


@REAL
def test_release_memory_is_refused_for_cpu_engines(sglang, tmp_path):
    """/release_memory_occupation kills a CPU SGLang server: rollout.sglang.release_memory is refused for attached CPU
    engines when they are first asked what they are (before any weights move), and at config load for engines
    launched with --device cpu."""
    from megatron_pdm.rollout.config import RolloutConfig

    engine = SGLangEngine(sglang_section(urls=(sglang.url,), release_memory=True, timeout_s=60), CFG,
                          weight_dir=tmp_path, dtype="bfloat16")
    with pytest.raises(ValueError, match="rollout.sglang.release_memory: true, but the SGLang engine at .* runs on a "
                                         "CPU"):
        engine.wait_ready(60)
    with pytest.raises(ValueError, match="rollout.sglang.release_memory: true with SGLang engines on a CPU"):
        RolloutConfig(engine="sglang", sglang={"num_engines": 1, "release_memory": True, "server_args": CPU_ARGS})
    assert call(sglang.url, "/health").status == 200


@REAL
def test_score_equals_serves_on_the_same_weights(sglang, tmp_path):
    """An engine teacher (`SGLangEngine.score`, prefill-only /generate) through real SGLang gives serve's top-K on
    the same bf16 weights (an export of seed 24 pushed by disk, which serve then loads): both within LOGPROB_ATOL of
    the fp32 recomputation, and the same top-K ids wherever the reference's order is decided by more than it."""
    from tests.helpers import _in_process_server

    seqs, starts, K = [[1, 5, 9, 17, 2, 33, 8, 41], [7, 3, 3, 100, 250, 11, 12]], [4, 1], 4
    engine = _client(sglang.url, tmp_path, weight_sync="disk")
    try:
        engine.update_weights(_state(24), version=90)
        real = engine.score(seqs, starts, K)
    finally:
        engine.close()
    server, url, stop = _in_process_server(tmp_path, CFG, path=tmp_path / "weights" / "v000090", dtype="bfloat16")
    try:
        ours = _client(url, tmp_path / "serve").score(seqs, starts, K)
    finally:
        stop()
    model = _reference(24)
    for seq, start, a, b in zip(seqs, starts, real, ours, strict=True):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([seq])).logits[0, start - 1: -1].float(), -1)
        ref_lps, ref_ids = lp.topk(K, dim=-1)
        for got in (a, b):
            assert (got.token_logprobs - lp.gather(1, torch.tensor(seq[start:])[:, None])[:, 0]).abs().max() \
                < LOGPROB_ATOL
            assert (got.topk_logprobs - ref_lps).abs().max() < LOGPROB_ATOL
        gap = ref_lps[:, :-1] - ref_lps[:, 1:]
        clear = torch.ones_like(ref_ids, dtype=torch.bool)
        clear[:, :-1] &= gap > 2 * LOGPROB_ATOL
        clear[:, 1:] &= gap > 2 * LOGPROB_ATOL
        assert clear.any()
        assert torch.equal(a.topk_ids[clear], ref_ids[clear]) and torch.equal(b.topk_ids[clear], ref_ids[clear])


# -- the trainer -------------------------------------------------------------------------------------------------------
def _train_config(init: Path, **rollout) -> dict:
    """A few steps of the main job's task and model at TP 1, on SGLang engines (bf16, as the shared server)."""
    return {"model": {**MODEL, "tokenizer": str(ARITHMETIC_TOKENIZER)}, "parallel": {},
            "objective": {"mask": "pdm", "divergence": "topk_kl", "delta": 0.15, "top_k": 4},
            "precision": {"rollout": "bf16"},
            "rollout": {"engine": "sglang", "n": 2, "max_new_tokens": 4, "timeout_s": 120, "update_timeout_s": 300,
                        **rollout},
            "data": {"task": "arithmetic", "chat_template": True, "max_operand": 9},
            "train": {"steps": 2, "prompts_per_step": 4, "minibatches": 1, "micro_batch_size": 8, "eval_every": 100,
                      "eval_prompts": 4, "checkpoint_every": 1000, "init": "hf", "init_path": str(init),
                      "warm_start_steps": 0, "seed": 1}}


def train(tmp_path: Path, config: dict | Path, *overrides: str, env=None) -> tuple[list[dict], Path, str]:
    """`megatron-pdm train` as a user runs it, its output read through a pipe (`| tee log`): (metrics rows, run
    dir, output). It must return, and the pipe close, when the run ends: torch's shared-memory daemon, started by
    the tensor transport, held the trainer's stderr and its rank's spawn sentinel, and `train` never returned."""
    run = tmp_path / "run"
    if isinstance(config, dict):
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
        config = tmp_path / "config.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_pdm.cli", "train", "--config", str(config), "--run-dir",
                             str(run), *overrides], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=60)  # the pipe's last writers exit with the trainer
    assert not reader.is_alive(), "the trainer exited but its output pipe stayed open (a child holds it)"
    output = chunks[0].decode(errors="replace")
    assert proc.returncode == 0, output[-5000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return rows, run, output


def _trained(rows, steps: int) -> None:
    """Every step ran and logged a finite reward in [0, 1] and finite divergences."""
    assert [r["step"] for r in rows if "train/reward" in r] == list(range(1, steps + 1)), rows
    for r in rows:
        for k in ("train/reward", "divergence/mean", "train/loss"):
            if k in r:
                assert torch.isfinite(torch.tensor(r[k])), (k, r)
        if "train/reward" in r:
            assert 0.0 <= r["train/reward"] <= 1.0


@REAL
@pytest.mark.parametrize(("sync", "schedule"), [("disk", "lagged"), ("distributed", "streaming")])
def test_trainer_attached_per_sync_mode_and_schedule(sglang, tmp_path, sync, schedule):
    """`megatron-pdm train` rolling out on the shared SGLang server by each weight sync; one-step-off (lagged) and
    streaming rollouts, whose samples cut by a weight update are continued by extend under the new weights. The
    rewards are not the embedded engine's: SGLang on a CPU draws anew for every request (seeds need
    --enable-deterministic-inference) and computes in bf16, so they differ by sampling."""
    rollout = {"urls": [sglang.url], "weight_sync": sync, "schedule": schedule}
    if schedule == "streaming":
        rollout.update(max_new_tokens=8, segment_tokens=3)
    rows, _, _ = train(tmp_path, _train_config(sglang.init, **rollout), "train.steps=3")
    _trained(rows, 3)
    if schedule == "streaming":  # samples of 8 tokens, 3 a step: each spans versions unless it stops early
        assert any(r.get("rollout/mixed_version_frac", 0) > 0 for r in rows), rows


@REAL
def test_trainer_calculator_multi_turn_by_tensor_sync(sglang, tmp_path):
    """The calculator example (examples/calculator.yaml: a tool turn after each expression the policy writes) on the
    shared SGLang server by tensor sync, the model warm-started from the demonstrations (40 steps: about half the
    samples call the tool, so that 32 samples in which none does have odds below 1e-9) so that it calls the tool:
    the engine continues each sample from its whole context (prompt, turns, tool replies)."""
    rows, _, _ = train(tmp_path, ROOT / "examples" / "calculator.yaml", "parallel.tensor=1",
                    f"model.max_position_embeddings={MODEL['max_position_embeddings']}", "rollout.engine=sglang",
                    f"rollout.sglang.urls=[{sglang.url}]", "rollout.sglang.weight_sync=tensor",
                    "precision.rollout=bf16",
                    "rollout.n=2", "rollout.sglang.timeout_s=120", "train.steps=2", "train.prompts_per_step=8",
                    "train.micro_batch_size=16", "train.eval_every=100", "train.eval_prompts=4",
                    "train.checkpoint_every=1000", "train.warm_start_steps=40")  # 40: the tool is called (16 of 32)
    _trained(rows, 2)
    assert any(r.get("rollout/turns", 1) > 1 for r in rows), rows  # the tool was called


@REAL
def test_trainer_launches_sglang_engines_behind_the_router(tmp_path):
    """rollout.sglang.num_engines 2 of `python -m sglang.launch_server` through rollout.sglang.engine_python (the CPU
    engine environment), started from the trainer's first export, sglang-router 0.3.2 in front of them, tensor sync (one
    shared-memory pickle per engine): both engines serve, and both stop with the run."""
    from megatron_pdm.rollout.sglang.launcher import router_available

    init = _export(tmp_path / "init", seed=21)
    rollout = {"num_engines": 2, "server": "sglang", "engine_python": PYTHON, "server_args": list(CPU_ARGS),
               "router": True, "weight_sync": "tensor"}
    rows, run, _ = train(tmp_path, _train_config(init, **rollout), env=CPU_ENV)
    _trained(rows, 2)
    logs = sorted((run / "logs").glob("engine-*.log"))
    assert [p.name for p in logs] == ["engine-0.log", "engine-1.log"]
    for p in logs:
        check_engine_log(p)
        assert "Prefill batch" in p.read_text(errors="replace"), f"{p.name}: the engine served no request"
    routed = re.sub(r"\x1b\[[0-9;]*m", "", (run / "logs" / "router.log").read_text(errors="replace"))
    assert router_available() and "uri=/generate" in routed, "the rollouts did not go through sglang-router"
    assert not [p for p in Path("/proc").glob("[0-9]*/cmdline") if str(run).encode() in _read(p)]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # a process that exited meanwhile
        return b""
