"""`megatron-pdm serve`: the embedded engine behind the subset of SGLang's HTTP worker API that we use.

Same request and response schema as SGLang (`/generate` with `return_logprob`, `top_logprobs_num`;
`meta_info.output_token_logprobs` = [[logprob, token_id, null], ...] and `output_top_logprobs` =
[[[logprob, id, null] x K], ...]), same log-prob semantics (log_softmax(logits / T) of the distribution sampled
from), plus `/health`, `/get_model_info`, `/update_weights_from_disk`, `/pause_generation` and
`/continue_generation`. It lets CPU CI exercise the real `SGLangEngine` client over loopback.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_pdm.models.hf import load_hf_checkpoint

from .base import SamplingParams
from .embedded import EmbeddedEngine


class _BadRequest(ValueError):
    pass


def _params(body: dict) -> tuple[list[list[int]], SamplingParams, bool]:
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise _BadRequest("input_ids: expected a list of token ids or a list of such lists")
    batch = isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    sp = body.get("sampling_params") or {}
    if float(sp.get("top_p", 1.0)) != 1.0 or int(sp.get("top_k", -1)) not in (-1, 0):
        raise _BadRequest("sampling_params: this server samples the untruncated distribution (top_p = 1, "
                          f"top_k = -1), got top_p={sp.get('top_p')} top_k={sp.get('top_k')}")
    k = int(body.get("top_logprobs_num", 1) or 1)
    try:
        params = SamplingParams(max_new_tokens=int(sp.get("max_new_tokens", 16)), n=1,
                                temperature=float(sp.get("temperature", 1.0)), top_k_logprobs=k,
                                stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
                                seed=sp.get("sampling_seed"))
    except ValueError as e:
        raise _BadRequest(str(e)) from None
    return prompts, params, batch


class EngineServer:
    def __init__(self, model_path: str, *, dtype: str = "float32", quantization: str | None = None):
        state, cfg = load_hf_checkpoint(model_path)
        self.engine = EmbeddedEngine(cfg, dtype=dtype, quantization=quantization)
        self.engine.update_weights(state, version=0)
        self.model_path = model_path
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.running.set()

    def generate(self, body: dict):
        prompts, params, batch = _params(body)
        self.running.wait()  # paused around weight updates
        with self.lock:
            samples = self.engine.generate(prompts, params)
            version = self.engine.weight_version
        out = []
        for s in samples:
            meta = {
                "finish_reason": {"type": s.finish_reason},
                "prompt_tokens": len(s.prompt_ids),
                "completion_tokens": len(s.response_ids),
                "weight_version": str(version),
            }
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                                 zip(s.token_logprobs.tolist(), s.response_ids.tolist(), strict=True)]
                meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
                                               for lps, ids in zip(s.topk_logprobs.tolist(), s.topk_ids.tolist(),
                                                                   strict=True)]
            out.append({"text": "", "output_ids": s.response_ids.tolist(), "meta_info": meta})
        return out if batch else out[0]

    def update_weights_from_disk(self, body: dict):
        path = body.get("model_path")
        if not isinstance(path, str):
            raise _BadRequest("model_path: expected a directory path")
        state, cfg = load_hf_checkpoint(path)
        if cfg != self.engine.cfg:
            raise _BadRequest(f"model_path: {path} holds a different model ({cfg})")
        with self.lock:
            version = int(body.get("weight_version", self.engine.weight_version + 1))
            self.engine.update_weights(state, version)
            self.model_path = path
        return {"success": True, "message": f"loaded {path}", "weight_version": str(version)}

    def model_info(self):
        return {"model_path": self.model_path, "weight_version": str(self.engine.weight_version),
                "is_generation": True}


def make_handler(server: EngineServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: one line per request is noise in tests and logs
            pass

        def _reply(self, code: int, payload) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._reply(200 if server.engine.health() else 503, {"ok": server.engine.health()})
            elif self.path == "/get_model_info":
                self._reply(200, server.model_info())
            else:
                self._reply(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/generate":
                    self._reply(200, server.generate(body))
                elif self.path == "/update_weights_from_disk":
                    self._reply(200, server.update_weights_from_disk(body))
                elif self.path == "/pause_generation":
                    server.running.clear()
                    self._reply(200, {"success": True})
                elif self.path == "/continue_generation":
                    server.running.set()
                    self._reply(200, {"success": True})
                elif self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                    with server.lock:
                        if self.path == "/release_memory_occupation":
                            server.engine.release_memory()
                        else:
                            server.engine.resume_memory()
                    self._reply(200, {"success": True})
                else:
                    self._reply(404, {"error": f"no route {self.path}"})
            except (_BadRequest, json.JSONDecodeError, ValueError, FileNotFoundError) as e:
                self._reply(400, {"error": str(e)})

    return Handler


def serve(model_path: str, *, host: str = "127.0.0.1", port: int = 30000, dtype: str = "float32",
          quantization: str | None = None) -> None:
    server = EngineServer(model_path, dtype=dtype, quantization=quantization)
    httpd = ThreadingHTTPServer((host, port), make_handler(server))
    print(f"serving {model_path} on http://{host}:{port}", flush=True)
    httpd.serve_forever()
