"""/update_weights_from_tensor unpickles a request body: `deserialize_named_tensors` admits exactly the globals that
`serialize_named_tensors` sends and never runs code from a request (a payload that would is refused before anything
is called), while every dtype the trainer sends still makes the round trip; `serve` answers such a request 400."""

import base64
import io
import json
import os
import pickle
import pickletools
import subprocess
import urllib.error
import urllib.request

import pytest
import torch

from megatron_pdm.rollout.sglang import weight_transfer as wt

CUDA_ONLY = {("torch.multiprocessing.reductions", "rebuild_cuda_tensor"), ("torch.storage", "TypedStorage")}


class Reduces:
    """Pickles as `fn(*args)`, which unpickling would call."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payload(obj) -> str:
    """base64 of `obj` pickled as the sender pickles (real tensors in it pickle as the sender's do)."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    with wt._sharing_by_file():
        ForkingPickler(buf, 4).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def _memo_globals(raw: bytes) -> set[tuple[str, str]]:
    """The globals of a pickle, memo references included (a name string seen once is fetched again by BINGET)."""
    memo, stack, found = [], [], set()
    for op, arg, _ in pickletools.genops(raw):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"):
            stack.append(arg)
        elif op.name == "MEMOIZE":
            memo.append(stack[-1] if stack else None)
        elif op.name in ("BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif op.name == "STACK_GLOBAL":
            found.add((stack[-2], stack[-1]))
            stack[-2:] = [None]
        else:
            stack.append(None)
    return found


def test_the_sender_uses_only_admitted_globals_and_every_dtype_round_trips():
    """Every dtype (the trainer's: fp32, bf16, fp16, float8_e4m3fn, int32, int64, and the rest of TENSOR_DTYPES),
    0-d, empty and strided tensors come back equal; the sender's payloads use exactly the CPU part of the
    allow-list (if torch changes its reductions, this names the global to admit)."""
    assert set(wt.DTYPE_NAMES.values()) <= set(wt.TENSOR_DTYPES)
    used = set()
    for dtype in wt.TENSOR_DTYPES:
        full = torch.arange(-6, 6).reshape(3, 4).to(dtype)
        named = wt.shared([("w", full), ("strided", full.t()[1:, ::2]), ("scalar", full[1, 2]), ("empty", full[:0])])
        data = wt.serialize_named_tensors(named)
        used |= _memo_globals(base64.b64decode(data))
        out = wt.deserialize_named_tensors(data)
        assert [n for n, _ in out] == ["w", "strided", "scalar", "empty"]
        for (_, got), (_, sent) in zip(out, named, strict=True):
            assert got.dtype == dtype and got.shape == sent.shape and got.stride() == sent.stride()
            assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8))
    assert used == set(wt.admitted_globals()) - CUDA_ONLY


def test_cuda_payload_globals_are_admitted():
    """A CUDA tensor pickles as torch's reduce_tensor makes it (IPC handles, SGLang's path): its globals are admitted
    (with a GPU, a real CUDA tensor's pickle has the same ones; the round trip needs a second process, since CUDA
    does not open an IPC handle in the process that made it)."""
    from torch.multiprocessing import reductions

    like = Reduces(reductions.rebuild_cuda_tensor, torch.Tensor, torch.Size([2, 3]), (3, 1), 0,
                   torch.storage.TypedStorage, torch.bfloat16, 0, b"handle", 12, 0, False, b"ref", 0, b"event", True)
    assert _memo_globals(base64.b64decode(_payload([("w", like)]))) <= set(wt.admitted_globals())
    if torch.cuda.is_available():
        t = torch.arange(6, dtype=torch.bfloat16, device="cuda").reshape(2, 3)
        data = wt.serialize_named_tensors([("w", t)])
        assert _memo_globals(base64.b64decode(data)) == _memo_globals(base64.b64decode(_payload([("w", like)])))


def _attacks(marker):
    """(payload, the refused global or opcode) for payloads that would create `marker` or load code."""
    torch_load_target = str(marker) + ".pt"
    cmd = f"touch {marker}"
    real = wt.shared([("w", torch.ones(2))])
    return [
        (_payload([("w", Reduces(os.system, cmd))]), f"{os.system.__module__}.system"),
        (_payload(Reduces(os.system, cmd)), f"{os.system.__module__}.system"),
        (_payload([real[0], ("x", Reduces(subprocess.Popen, ["touch", str(marker)]))]), "subprocess.Popen"),
        (_payload([("w", Reduces(eval, f"open({str(marker)!r}, 'w').close()"))]), "builtins.eval"),
        (_payload([("w", Reduces(exec, f"open({str(marker)!r}, 'w').close()"))]), "builtins.exec"),
        (_payload([("w", Reduces(torch.load, torch_load_target))]), "torch.serialization.load"),
        (_payload([("w", Reduces(torch.serialization.load, torch_load_target))]), "torch.serialization.load"),
        # a protocol-0 GLOBAL (the classic exploit), and dotted names through admitted modules
        (base64.b64encode(f"cposix\nsystem\n(V{cmd}\ntR.".encode()).decode(), "posix.system"),
        (base64.b64encode(b"\x80\x04\x8c\x05torch\x8c\x12serialization.load\x93.").decode(),
         "torch.serialization.load"),
        (base64.b64encode(b"\x80\x04\x8c torch.multiprocessing.reductions\x8c\x05torch\x93.").decode(),
         "torch.multiprocessing.reductions.torch"),
        # admitted globals, but objects built by BUILD / NEWOBJ
        (_payload(_Build()), "opcode BUILD"),
        (base64.b64encode(b"\x80\x04\x8c\x05torch\x8c\x04Size\x93)\x81.").decode(), "opcode NEWOBJ"),
    ]


class _Build:
    """Pickles as torch.Size((1,)) followed by BUILD with a state dict."""

    def __reduce__(self):
        return torch.Size, ((1,),), {"x": 1}


def test_payloads_that_would_run_code_are_refused_before_anything_runs(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    calls = []
    spy = lambda *a, **k: calls.append(a)  # noqa: E731
    # pickled with the real functions, as base64 and as raw bytes (a fresh pickle each: each is good for one reader),
    # then every loader is a spy
    attacks = _attacks(marker) + [(base64.b64decode(data), refused) for data, refused in _attacks(marker)]
    for module, name in ((torch, "load"), (torch.serialization, "load"), (os, "system"), (subprocess, "Popen")):
        monkeypatch.setattr(module, name, spy)
    for data, refused in attacks:
        with pytest.raises(pickle.UnpicklingError, match=refused.replace(".", r"\.") + " .*not allowed"):
            wt.deserialize_named_tensors(data)
    assert not marker.exists() and calls == []
    for junk in (b"", b"not a pickle", b"\x80\x04\x95"):
        with pytest.raises(pickle.UnpicklingError):
            wt.deserialize_named_tensors(junk)


def _request(url, path, body=None):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None  # /health answers an empty body, as SGLang's does
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.e2e
def test_serve_answers_a_code_running_payload_400_and_keeps_serving(tmp_path):
    """A real `megatron-pdm serve` on loopback: the payload that would run `touch` is answered 400 naming the
    global, nothing is created, and the server still takes the trainer's update and generates."""
    from tests.helpers import _poll, _serve_processes, _stop

    procs, (url,), state = _serve_processes(tmp_path, 1, fork=False)  # the real command
    try:
        _poll(lambda: _ready(url), "serve never became healthy", 120)
        marker = tmp_path / "pwned"
        assert _request(url, "/begin_weight_update", {})[0] == 200  # tensor updates run inside a session (0.5.23)
        body = {"serialized_named_tensors": [_payload([("w", Reduces(os.system, f"touch {marker}"))])],
                "load_format": None, "flush_cache": True}
        code, reply = _request(url, "/update_weights_from_tensor", body)
        assert code == 400 and reply["success"] is False
        assert "UnpicklingError" in reply["message"] and f"{os.system.__module__}.system" in reply["message"]
        assert "Traceback" not in json.dumps(reply) and not marker.exists()
        named = wt.shared(list(state.items()))
        code, reply = _request(url, "/update_weights_from_tensor",
                               {"serialized_named_tensors": [wt.serialize_named_tensors(named)], "load_format": None,
                                "flush_cache": True, "weight_version": "3"})
        assert (code, reply["success"]) == (200, True), reply
        assert _request(url, "/end_weight_update", {})[0] == 200
        code, reply = _request(url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
        assert code == 200 and reply["meta_info"]["weight_version"] == "3"
        assert procs[0].poll() is None and not marker.exists()
    finally:
        _stop(procs)


def _ready(url):
    try:
        return _request(url, "/health")[0] == 200
    except OSError:
        return False
