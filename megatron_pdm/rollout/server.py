"""`megatron-pdm serve`: the embedded engine behind the subset of SGLang's HTTP worker API that we use.

Same request and response schema as SGLang (`/generate` with `return_logprob`, `top_logprobs_num`;
`meta_info.output_token_logprobs` = [[logprob, token_id, null], ...] and `output_top_logprobs` =
[[[logprob, id, null] x K], ...]), same log-prob semantics (log_softmax(logits / T) of the distribution sampled
from, `meta_info.routed_experts` = base64 of int32 [prompt + completion - 1, layers, top_k] with
`return_routed_experts`), plus `/health`, `/get_model_info`, `/get_weight_version`, the three weight-update
routes (`/update_weights_from_disk`, `/init_weights_update_group` + `/update_weights_from_distributed` +
`/destroy_weights_update_group`, `/update_weights_from_tensor`), `/flush_cache`, `/pause_generation`,
`/continue_generation`, `/release_memory_occupation` and `/resume_memory_occupation`. Every weight update may
carry `weight_version`, which the server reports in each response's meta_info, as SGLang does. It lets CPU CI
exercise the real `SGLangEngine` client over loopback.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_pdm.models.hf import load_hf_checkpoint
from megatron_pdm.models.tokenizer import has_tokenizer, load_tokenizer

from . import weight_transfer
from .base import SamplingParams
from .embedded import EmbeddedEngine

log = logging.getLogger(__name__)


class _BadRequest(ValueError):
    pass


def _params(body: dict) -> tuple[list[list[int]], SamplingParams, bool]:
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise _BadRequest("input_ids: expected a list of token ids or a list of such lists")
    batch = isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    sp = body.get("sampling_params") or {}
    k = int(body.get("top_logprobs_num", 1) or 1)
    top_k = int(sp.get("top_k", -1))
    try:
        params = SamplingParams(max_new_tokens=int(sp.get("max_new_tokens", 16)), n=1,
                                temperature=float(sp.get("temperature", 1.0)), top_k_logprobs=k,
                                stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
                                seed=sp.get("sampling_seed"), top_p=float(sp.get("top_p", 1.0)),
                                top_k=-1 if top_k == 0 else top_k,
                                return_routed_experts=bool(body.get("return_routed_experts")))
    except ValueError as e:
        raise _BadRequest(str(e)) from None
    return prompts, params, batch


class EngineServer:
    """tokenizer: a tokenizer directory (default: model_path's own tokenizer files, when it has them), which
    decodes each response's `text` as SGLang does; without one, `text` is empty (SGLang's --skip-tokenizer-init)."""

    def __init__(self, model_path: str, *, dtype: str = "float32", quantization: str | None = None,
                 weight_version: int = 0, tokenizer: str | None = None):
        state, cfg = load_hf_checkpoint(model_path)
        tokenizer = tokenizer or (model_path if has_tokenizer(model_path) else None)
        self.tokenizer = None if tokenizer is None else load_tokenizer(tokenizer, embedding_rows=cfg.vocab_size,
                                                                        field="serve --tokenizer")
        self.engine = EmbeddedEngine(cfg, dtype=dtype, quantization=quantization)
        self.engine.update_weights(state, version=weight_version)
        self.model_path = model_path
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.running.set()
        self.groups: dict[str, weight_transfer.WeightsGroup] = {}

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
            if s.routed_experts is not None:
                meta["routed_experts"] = base64.b64encode(s.routed_experts.contiguous().numpy().tobytes()).decode()
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                                 zip(s.token_logprobs.tolist(), s.response_ids.tolist(), strict=True)]
                meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
                                               for lps, ids in zip(s.topk_logprobs.tolist(), s.topk_ids.tolist(),
                                                                   strict=True)]
            text = "" if self.tokenizer is None else self.tokenizer.decode(s.response_ids.tolist())
            out.append({"text": text, "output_ids": s.response_ids.tolist(), "meta_info": meta})
        return out if batch else out[0]

    def update_weights_from_disk(self, body: dict):
        path = body.get("model_path")
        if not isinstance(path, str):
            raise _BadRequest("model_path: expected a directory path")
        state, cfg = load_hf_checkpoint(path)
        if cfg != self.engine.cfg:
            raise _BadRequest(f"model_path: {path} holds a different model ({cfg})")
        with self.lock:
            version = self._version(body)
            self.engine.update_weights(state, version)
            self.model_path = path
        return {"success": True, "message": f"loaded {path}", "weight_version": str(version)}

    def _version(self, body: dict) -> int:
        v = body.get("weight_version")
        if v is None:
            return self.engine.weight_version
        try:
            return int(v)
        except (TypeError, ValueError):
            raise _BadRequest(f"weight_version: expected an integer, got {v!r}") from None

    def init_weights_update_group(self, body: dict):
        """Join the trainer's group as rank rank_offset (this server is one engine rank); blocks until every
        rank joined."""
        try:
            name, rank = str(body["group_name"]), int(body["rank_offset"])
            group = weight_transfer.weights_group(str(body["master_address"]), int(body["master_port"]), rank,
                                                  int(body["world_size"]), name, backend=body.get("backend", "nccl"))
        except KeyError as e:
            raise _BadRequest(f"{e.args[0]}: missing") from None
        self.groups[name] = group
        return {"success": True, "message": f"joined {name} as rank {rank}"}

    def update_weights_from_distributed(self, body: dict):
        """Receive one bucket: a broadcast from rank 0 per announced (name, dtype, shape), then load it."""
        group = self.groups.get(body.get("group_name"))
        if group is None:
            raise _BadRequest(f"group_name: {body.get('group_name')!r} is not a joined group ({sorted(self.groups)})")
        return self._load(weight_transfer.receive_tensors(group, body.get("names") or [], body.get("dtypes") or [],
                                                          body.get("shapes") or []), body)

    def destroy_weights_update_group(self, body: dict):
        if self.groups.pop(body.get("group_name"), None) is None:
            raise _BadRequest(f"group_name: {body.get('group_name')!r} is not a joined group")
        return {"success": True}

    def update_weights_from_tensor(self, body: dict):
        """serialized_named_tensors: one entry per engine TP rank (this server has one)."""
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or len(entries) != 1:
            raise _BadRequest("serialized_named_tensors: expected a list with one entry per TP rank (1 here)")
        if body.get("load_format") not in (None, "direct"):
            raise _BadRequest(f"load_format: {body.get('load_format')!r} is not supported (None or 'direct')")
        return self._load(weight_transfer.deserialize_named_tensors(entries[0]), body)

    def _load(self, named, body: dict):
        """Load some weights and take the version the update carries (a bucket without one keeps the current)."""
        with self.lock:
            self.engine.load_weights(named)
            self.engine.weight_version = self._version(body)
        return {"success": True, "message": f"loaded {len(named)} tensors",
                "weight_version": str(self.engine.weight_version)}

    def model_info(self):
        return {"model_path": self.model_path, "weight_version": str(self.engine.weight_version),
                "is_generation": True}


ROUTES = {f"/{name}": name for name in ("update_weights_from_disk", "init_weights_update_group",
                                        "update_weights_from_distributed", "destroy_weights_update_group",
                                        "update_weights_from_tensor")}


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
            elif self.path == "/get_weight_version":
                self._reply(200, {"weight_version": str(server.engine.weight_version)})
            else:
                self._reply(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/generate":
                    self._reply(200, server.generate(body))
                elif self.path in ROUTES:
                    self._reply(200, getattr(server, ROUTES[self.path])(body))
                elif self.path == "/flush_cache":  # no prefix cache to flush: every request is computed afresh
                    self._reply(200, {"success": True})
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
            except Exception as e:  # a failed collective or load: the server lives on, the client sees why
                log.exception("%s failed", self.path)
                self._reply(500, {"error": f"{type(e).__name__}: {e}"})

    return Handler


def serve(model_path: str, *, host: str = "127.0.0.1", port: int = 30000, dtype: str = "float32",
          quantization: str | None = None, weight_version: int = 0, tokenizer: str | None = None) -> None:
    server = EngineServer(model_path, dtype=dtype, quantization=quantization, weight_version=weight_version,
                          tokenizer=tokenizer)
    httpd = ThreadingHTTPServer((host, port), make_handler(server))
    print(f"serving {model_path} on http://{host}:{port}", flush=True)
    httpd.serve_forever()
