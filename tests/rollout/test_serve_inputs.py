"""`megatron-pdm serve` against malformed input (bad or huge Content-Length, non-integer fields, a checkpoint of
another model), block-FP8 halves that never pair within an update, and the shared-memory files of weight-update
pickles that no engine read. One in-process server (DENSE, seed 21) serves the whole module."""

import json
import socket
import time
from dataclasses import replace

import pytest
import torch

from megatron_pdm.models import canonical_hf_state, save_hf_checkpoint
from megatron_pdm.precision import FP8_SCALE_SUFFIX, fp8_block_state
from megatron_pdm.rollout.sglang import weight_transfer as wt
from megatron_pdm.rollout.sglang.pool import Rejected, post, request
from megatron_pdm.rollout.sglang.server import MAX_BODY_BYTES
from tests.helpers import DENSE, _in_process_server, hf_model

FP8_KEY = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """(EngineServer, url) of one in-process serve (test hooks on), stopped at the end of the module."""
    server, url, stop = _in_process_server(tmp_path_factory.mktemp("serve"), DENSE, test_hooks=True)
    yield server, url
    stop()


def _raw(url: str, head: bytes, body: bytes = b"", timeout: float = 2.0) -> bytes:
    """Send raw request bytes; the answer's bytes (all of them, until the server closes or `timeout` passes)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


@pytest.mark.parametrize("length, code", [(b"abc", 400), (b"-1", 400), (b"1" + b"0" * 15, 413),
                                          (str(MAX_BODY_BYTES + 1).encode(), 413), (b"1" + b"0" * 40, 413)])
def test_a_bad_or_huge_content_length_is_answered_at_once_and_serve_lives_on(serve, length, code):
    """Content-Length `abc` (a traceback and no answer before), `-1` (a handler reading until the client left) and
    `10**15` (allocated up front: MemoryError) are each answered within 2 s, 400 or 413 naming the header and its
    value, with the connection closed (the body is never read); /health answers afterwards."""
    _, url = serve
    start = time.monotonic()
    answer = _raw(url, b"POST /pause_generation HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n",
                  b"{}")
    assert time.monotonic() - start < 2
    status, _, rest = answer.partition(b"\r\n")
    assert status.split()[1] == str(code).encode(), answer
    head, _, body = rest.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert "Content-Length" in error and length.decode() in error
    assert request(url, "/health", None, 5) is None  # 200, an empty body (SGLang's)


def test_a_post_without_content_length_still_has_an_empty_body(serve):
    """A POST with no Content-Length (`curl -X POST`) is an empty body, `{}`, as before (RFC 9112)."""
    _, url = serve
    answer = _raw(url, b"POST /flush_cache HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and b"Cache flushed." in answer  # SGLang's text/plain answer


@pytest.mark.parametrize("field", ["rank_offset", "master_port", "world_size"])
def test_a_non_integer_group_field_is_named(serve, field):
    """/init_weights_update_group with "abc" in an integer field: 400 naming the field and the value (before,
    `invalid literal for int()` without the field), no group made."""
    server, url = serve
    body = {"group_name": "g", "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
            "backend": "gloo", field: "abc"}
    with pytest.raises(Rejected, match=f"HTTP 400.*{field}: expected an integer, got 'abc'"):
        post(url, "/init_weights_update_group", body, 5)
    assert server.groups == {}


def test_a_non_integer_fault_field_is_named(serve):
    """The test hooks' counts: a bad one is named, and changes nothing."""
    server, url = serve
    with pytest.raises(Rejected, match="HTTP 400.*fail_updates: expected an integer, got 'abc'"):
        post(url, "/megatron_pdm/faults", {"fail_updates": "abc"}, 5)
    assert server.fail_updates == 0


@pytest.mark.parametrize("route, body, named", [
    ("/generate", [1, 2, 3], "body: expected a JSON object, got an array"),
    ("/generate", "hello", "body: expected a JSON object, got a string"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"sampling_seed": "abc"}},
     "sampling_params.sampling_seed: expected an integer, got 'abc'"),
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{}, {"temperature": "hot"}]},
     "sampling_params\\[1\\].temperature: expected a number, got 'hot'"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": "ab"}},
     "sampling_params.stop_token_ids: expected a list of integers"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": [4]}},
     "sampling_params.max_new_tokens: expected an integer, got \\[4\\]"),
    ("/generate", {"input_ids": [1], "sampling_params": "greedy"}, "sampling_params: expected an object"),
    ("/generate", {"input_ids": [1, "a"]}, "input_ids: expected a list of token ids"),
    ("/generate", {"input_ids": [[1], 2]}, "input_ids: expected a list of token ids"),
    ("/generate", {"input_ids": {"a": 1}}, "input_ids: expected a list of token ids"),
    ("/generate", {"input_ids": [1], "return_logprob": "false"}, "return_logprob: expected true or false"),
    ("/generate", {"input_ids": [1], "top_logprobs_num": [5]}, "top_logprobs_num: expected an integer"),
    ("/flush_cache", [], "body: expected a JSON object"),
    ("/pause_generation", {"mode": ["abort"]}, "mode: expected a string"),
    ("/update_weights_from_disk", ["x"], "body: expected a JSON object"),
    ("/update_weights_from_disk", {"model_path": ["x"]}, "model_path: expected a string"),
    ("/update_weights_from_disk", {"model_path": "x", "weight_version": [1]}, "weight_version: expected an integer"),
    ("/init_weights_update_group", {"group_name": ["g"], "rank_offset": 1, "master_address": "127.0.0.1",
                                    "master_port": 1, "world_size": 2}, "group_name: expected a string"),
    ("/update_weights_from_distributed", {"group_name": {"g": 1}}, "group_name: expected a string"),
    ("/update_weights_from_distributed", {"group_name": "g", "names": "w"}, "names: expected a list of strings"),
    ("/update_weights_from_distributed", {"group_name": "g", "shapes": [3]}, "shapes: expected a list of shapes"),
    ("/destroy_weights_update_group", {"group_name": 7}, "group_name: expected a string, got 7"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": [1]}, "serialized_named_tensors: expected a list"),
    ("/megatron_pdm/faults", {"delay_s": "x"}, "delay_s: expected a number, got 'x'"),
    ("/megatron_pdm/faults", {"fail_group": 3}, "fail_group: expected a string, got 3"),
])
def test_a_body_or_field_of_the_wrong_json_type_is_a_400_naming_it(serve, caplog, route, body, named):
    """Every route's body and every field its handler reads, of the wrong JSON type: HTTP 400 naming the field
    and the value, before any handler runs, with no traceback logged (before: /generate answered 500 to a JSON
    array body or a string sampling_seed, and the update routes logged a traceback); serve answers afterwards."""
    server, url = serve
    with caplog.at_level("ERROR", logger="megatron_pdm.rollout.sglang.server"), \
            pytest.raises(Rejected, match=f"HTTP 400: .*{named}") as e:
        post(url, route, body, 30)
    assert e.value.code == 400 and "Traceback" not in str(e.value)
    assert not [r for r in caplog.records if r.exc_info], caplog.text
    assert server.running.is_set() and server.groups == {} and not server.session
    assert request(url, "/health", None, 5) is None  # 200, an empty body (SGLang's)


def test_null_fields_are_absent_and_integers_may_be_strings(serve):
    """SGLang's null (None) defaults: a null field is an absent one; an integer field takes a string holding one
    (SGLang sends weight_version so): a /generate with both answers as usual."""
    _, url = serve
    out = post(url, "/generate", {"input_ids": [[1, 2, 3]], "return_logprob": True, "top_logprobs_num": None,
                                  "sampling_params": [{"max_new_tokens": "2", "sampling_seed": None,
                                                       "stop_token_ids": None, "temperature": 1}]}, 30)
    assert len(out) == 1 and len(out[0]["output_ids"]) == 2 and len(out[0]["meta_info"]["output_top_logprobs"]) == 2


def test_a_disk_update_of_another_model_names_the_differing_field(serve, tmp_path):
    """A checkpoint of another architecture: 400 naming the field that differs and both values (before, the whole
    ModelConfig)."""
    _, url = serve
    other = replace(DENSE, ffn_hidden_size=64)
    save_hf_checkpoint(tmp_path / "other", canonical_hf_state(hf_model(other).state_dict()), other)
    with pytest.raises(Rejected, match=r"model\.ffn_hidden_size: 48 \(checkpoint: 64\)") as e:
        post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "other")}, 30)
    assert "num_layers" not in str(e.value)


# -- block-FP8 halves -------------------------------------------------------------------------------------------
def _fp8_state(engine, shift: float) -> dict:
    """The engine's weights + shift, as the block-FP8 checkpoint tensors an FP8 engine takes."""
    state = {k: v.float() + shift for k, v in canonical_hf_state(engine.model.state_dict()).items()
             if k in engine.checkpoint_keys()}
    return fp8_block_state(state)


@pytest.fixture(scope="module")
def fp8_engine():
    from megatron_pdm.rollout.embedded import EmbeddedEngine

    torch.manual_seed(0)
    engine = EmbeddedEngine(DENSE, dtype="bfloat16", quantization="fp8")
    engine.update_weights(_fp8_state(engine, 0.0), version=1)
    return engine


@pytest.mark.parametrize("drop, missing", [(FP8_SCALE_SUFFIX, f"block-FP8 .*no {FP8_KEY}{FP8_SCALE_SUFFIX}"),
                                           ("", rf"missing \['{FP8_KEY}'\]")])
def test_an_update_missing_one_half_of_a_block_fp8_weight_fails_naming_it(fp8_engine, drop, missing):
    """An update (a stream of buckets, or a full dict) whose block-FP8 weight lacks its `_scale_inv` (or its float8
    q, a missing weight): ValueError naming the weight and the missing half, no new version (before: the version
    was set while the engine kept the old weight), and no half held into the next update, which loads as usual."""
    engine = fp8_engine
    new = _fp8_state(engine, 1.0)
    del new[FP8_KEY + drop]
    with pytest.raises(ValueError, match=missing):
        engine.update_weights(iter([new]), version=2)
    assert engine.weight_version == -1 and engine._fp8_halves == {}  # a failed stream holds no valid version
    engine.update_weights(_fp8_state(engine, 0.0), version=3)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(ValueError, match=missing):
        engine.update_weights(new, version=4)  # a full dict: checked before anything loads
    assert engine.weight_version == 3 and engine._fp8_halves == {}
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())


def test_a_serve_session_missing_a_scale_fails_at_its_end(serve):
    """In serve the halves of a weight may come in different requests of one session: a scale still missing at
    /end_weight_update fails it (400 naming the weight), with the version the session opened with; the next
    session starts with no half held and ends as usual."""
    server, url = serve
    version = server.engine.weight_version
    q = fp8_block_state({FP8_KEY: server.engine.model.state_dict()[FP8_KEY].float()})[FP8_KEY]

    def update(named, weight_version):
        body = {"serialized_named_tensors": [wt.serialize_named_tensors(wt.shared(named))], "load_format": None,
                "weight_version": str(weight_version)}
        return post(url, "/update_weights_from_tensor", body, 30)

    post(url, "/begin_weight_update", {}, 5)
    assert update([(FP8_KEY, q)], version + 1)["success"]
    with pytest.raises(Rejected, match=f"HTTP 400.*end_weight_update: .*no {FP8_KEY}{FP8_SCALE_SUFFIX}"):
        post(url, "/end_weight_update", {}, 5)
    assert server.engine.weight_version == version and not server.session
    post(url, "/begin_weight_update", {}, 5)
    assert server.engine._fp8_halves == {}
    assert post(url, "/end_weight_update", {}, 5)["success"]
